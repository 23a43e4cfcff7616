"""One warm pool per kind, pools that cannot start, and interrupts, as a notebook user meets them.

* Re-running ``Cluster(2)`` stops the previous pool of that kind (its ranks exit within
  seconds) and the old object forwards ``run`` to the new one; ``replace=False`` keeps a pool
  of one's own.
* A pool that cannot start says why as soon as that is known, naming the stage each rank
  reached, instead of holding the next run for the whole start timeout.
* A kernel interrupt prints one line, no frames from inside labkit.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import labkit
import labkit.cluster
import labkit.startup
from labkit import jobs

pytestmark = pytest.mark.distributed


def _alive(pids) -> list:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _gone(pids, within: float) -> bool:
    deadline = time.monotonic() + within
    while _alive(pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_new_cluster_replaces_the_old_pool_and_the_old_object_follows():
    a = labkit.Cluster(2, threads_per_rank=1)
    b = own = None
    try:
        first = a.pids
        assert a.run(jobs.hello).outputs[1]["rank_sum"] == 1.0
        b = labkit.Cluster(2, threads_per_rank=1)            # the cell, run again
        assert _gone(first, within=10.0), "the replaced pool's ranks are still running"
        assert a.replaced and a.current is b and a.state == "replaced" and not a.pids
        assert "replaced by a newer Cluster(world_size=2" in repr(a)
        pids = {o["pid"] for o in a.run(jobs.hello).outputs}  # a widget holding `a`
        assert pids == set(b.pids) and not b.replaced
        own = labkit.Cluster(2, threads_per_rank=1, replace=False)  # asked for a second pool
        assert own.run(jobs.hello).outputs[0]["rank_sum"] == 1.0
        assert not b.replaced and b.alive and not own.replaced
        assert len(_alive(b.pids + own.pids)) == 4
    finally:
        for c in (a, b, own):
            if c is not None:
                c.close()


def test_a_rank_that_dies_while_starting_is_reported_at_once():
    """A rank killed while it imports torch: run raises at once (a RankError naming the
    stage), not a TimeoutError after the 600 s start timeout; the next run starts fresh
    ranks."""
    c = labkit.Cluster(2, threads_per_rank=1, start_timeout_s=600, replace=False)
    try:
        os.kill(c.pids[1], signal.SIGKILL)
        with pytest.raises(labkit.RankError, match=r"while (starting Python|importing torch)"
                                                   r":\nrank process 1 .* died") as info:
            c.run(jobs.hello)
        assert "startup" in str(info.value) and c.state == "closed"
        assert c.run(jobs.hello).outputs[1]["rank_sum"] == 1.0
    finally:
        c.close()


def test_ranks_stuck_in_the_rendezvous_are_reported_after_the_join_timeout(monkeypatch):
    """The store's folder vanishes while the ranks import torch, so init_process_group can
    never complete (the FileStore waits for its file): the error names the stage after
    JOIN_TIMEOUT_S, long before the 600 s start timeout."""
    monkeypatch.setattr(labkit.startup, "JOIN_TIMEOUT_S", 3.0)
    c = labkit.Cluster(2, threads_per_rank=1, start_timeout_s=600, replace=False)
    try:
        shutil.rmtree(c._tmp)
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] reached init_process_group "
                                               r"but the process group did not form within 3 s "
                                               r"\(ranks 0, 1 still joining"):
            c.run(jobs.hello)
        assert c.state == "closed"
        assert c.run(jobs.hello).outputs[1]["rank_sum"] == 1.0
    finally:
        c.close()


def test_start_timeout_names_where_each_rank_stopped():
    c = labkit.Cluster(2, threads_per_rank=1, start_timeout_s=5, replace=False)
    try:
        os.kill(c.pids[1], signal.SIGSTOP)  # before it even runs Python's main
        with pytest.raises(TimeoutError, match=r"did not start within 5 s \(.*rank 1 still "
                                               r"(starting Python|importing torch)"):
            c.run(jobs.hello)
    finally:
        c.close()


_IPYTHON = textwrap.dedent("""
    import os, signal, threading
    from IPython.core.interactiveshell import InteractiveShell
    sh = InteractiveShell.instance()
    sh.run_cell("import labkit; c = labkit.Cluster(2, threads_per_rank=1); "
                "c.run(labkit.jobs.hello)")
    threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    print("-8<-", flush=True)
    sh.run_cell("c.run(labkit.jobs.sleep, 120)")
    print("-8<-", flush=True)
    print("after:", sh.run_cell("c.run(labkit.jobs.hello).outputs[1]['rank_sum']").result)
""")


def test_interrupt_prints_one_line_and_the_pool_recovers(tmp_path):
    """What Kernel > Interrupt shows in a notebook: IPython renders the exception, and
    labkit's JobCancelled renders as one line, not 40-58 lines through cluster.py and
    selectors.py."""
    script = tmp_path / "interrupt.py"
    script.write_text(_IPYTHON)
    root = os.path.dirname(os.path.dirname(os.path.abspath(labkit.__file__)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=dict(os.environ, PYTHONPATH=root))
    shown = proc.stdout.split("-8<-")[1]
    lines = [ln for ln in shown.splitlines() if ln.strip()]
    assert lines == ["KeyboardInterrupt: job labkit.jobs.sleep cancelled on 2 ranks; pool "
                     "restarting"], proc.stdout + proc.stderr
    assert "after: 1.0" in proc.stdout, proc.stdout + proc.stderr


def test_job_cancelled_is_a_keyboard_interrupt_of_one_line():
    err = labkit.cluster.JobCancelled("job x cancelled on 4 ranks; pool restarting")
    assert isinstance(err, KeyboardInterrupt)
    assert err._render_traceback_() == ["KeyboardInterrupt: job x cancelled on 4 ranks; "
                                        "pool restarting"]
