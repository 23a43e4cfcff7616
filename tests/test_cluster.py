"""The warm cluster: jobs, faults, timeouts, interrupts, clean shutdown, loopback only."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import labkit
from labkit import jobs


def test_hello_runs_on_every_rank(cluster4):
    r = cluster4.run(jobs.hello)
    assert [o["rank"] for o in r.outputs] == [0, 1, 2, 3]
    assert all(o["rank_sum"] == 6.0 for o in r.outputs)
    assert len({o["pid"] for o in r.outputs}) == 4
    assert all(o["threads"] >= 1 for o in r.outputs)


def test_fewer_ranks_than_world(cluster4):
    r = cluster4.run(jobs.hello, nranks=2)
    assert len(r.outputs) == 2 and r.outputs[1]["rank_sum"] == 1.0
    assert cluster4.run(jobs.hello).outputs[3]["rank_sum"] == 6.0  # the rest were idle


def test_warm_rerun_is_fast(cluster4):
    cluster4.run(jobs.hello)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        cluster4.run(jobs.hello)
        times.append(time.perf_counter() - t0)
    assert min(times) < 0.5, times


def test_rank_error_carries_traceback_and_pool_recovers(cluster4):
    t0 = time.perf_counter()
    with pytest.raises(labkit.RankError) as info:
        cluster4.run(jobs.fail, 2)
    assert time.perf_counter() - t0 < 5.0
    assert info.value.rank == 2
    assert "deliberate failure on rank 2" in info.value.remote_traceback
    assert "Traceback" in info.value.remote_traceback
    assert cluster4.run(jobs.hello).outputs[0]["rank_sum"] == 6.0


def test_timeout_restarts(cluster4):
    old = cluster4.pids
    with pytest.raises(TimeoutError, match="did not finish within 1"):
        cluster4.run(jobs.sleep, 30, timeout_s=1)
    assert cluster4.pids != old
    assert cluster4.run(jobs.hello).outputs[1]["rank"] == 1
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in old)


def test_keyboard_interrupt_cancels_and_restarts(cluster2):
    cluster2.run(jobs.hello)
    old = cluster2.pids
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        cluster2.run(jobs.sleep, 30)
    assert cluster2.pids != old
    assert cluster2.run(jobs.hello).outputs[1]["rank_sum"] == 1.0


def _local_job(ctx, cfg):
    return 1


def test_unimportable_job_refused_before_launch(cluster2):
    def nested(ctx, cfg):
        return 1

    with pytest.raises(TypeError, match="nested function"):
        cluster2.run(nested)
    with pytest.raises(TypeError, match="importable"):
        cluster2.run(lambda ctx, cfg: 1)
    _local_job.__module__ = "__main__"  # what a notebook cell's function looks like
    try:
        with pytest.raises(TypeError, match="notebook cell|__main__"):
            cluster2.run(_local_job)
    finally:
        _local_job.__module__ = __name__


def test_config_of_the_wrong_class_refused_before_launch(cluster2):
    """The job's annotated config class is checked in the caller, before the ranks get the
    job; the pool stays usable."""
    from labkit.collectives.jobs import collective
    from labkit.config import RunConfig
    from labkit.train import run as train

    cluster = cluster2
    with pytest.raises(TypeError, match=r"labkit.train.run takes a RunConfig .* got NoneType"):
        cluster.run(train, None)
    with pytest.raises(TypeError, match="takes a CollectiveConfig as its config, got RunConfig"):
        cluster.run(collective, RunConfig())
    with pytest.raises(TypeError, match="got int"):
        cluster.run("labkit.train:run", 3)
    for bad in (None, {}, "train"):  # labkit.jobs.train, the README's first job, too
        with pytest.raises(TypeError, match="labkit.jobs.train takes a RunConfig"):
            cluster.run(labkit.jobs.train, bad)
    with pytest.raises(TypeError, match="an instance, got the class RunConfig"):
        cluster.run(labkit.jobs.train, RunConfig)
    assert cluster.run(train, RunConfig(steps=1)).losses


def test_more_ranks_than_the_machine_can_hold_is_refused():
    from labkit.preflight import MAX_RANKS_PER_CORE, cpu_cores

    n = MAX_RANKS_PER_CORE * cpu_cores() + 1
    with pytest.raises(ValueError, match=f"world_size={n} would start {n} rank processes"):
        labkit.Cluster(n)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        labkit.Cluster(0)
    with pytest.raises(ValueError, match="backend"):
        labkit.Cluster(2, backend="mpi")
    with pytest.raises(ValueError, match="GPU"):
        labkit.Cluster(64, backend="nccl")


def test_listeners_are_loopback_only(cluster4):
    cluster4.run(jobs.hello)
    pids = set(cluster4.pids) | {os.getpid()}
    bad = [c for c in psutil.net_connections(kind="inet")
           if c.status == psutil.CONN_LISTEN and c.pid in pids
           and c.laddr.ip not in ("127.0.0.1", "::1")]
    assert not bad, bad


_SCRIPT = textwrap.dedent("""
    import os, sys, labkit
    c = labkit.Cluster(2)
    c.run(labkit.jobs.hello)
    print(" ".join(map(str, c.pids)), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), 9)
    elif sys.argv[1] == "recreate":
        c = labkit.Cluster(2)        # re-running the cell: the old pool is dropped
        c.run(labkit.jobs.hello)
        print(" ".join(map(str, c.pids)), flush=True)
    # "exit": leave without close(); atexit must clean up
""")


def _gone(pids, within=10.0) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("mode", ["exit", "kill", "recreate"])
def test_no_rank_processes_left_behind(tmp_path, mode):
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(labkit.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                          timeout=120, env=env)
    pids = [int(p) for line in proc.stdout.split("\n") for p in line.split()]
    assert len(pids) == (4 if mode == "recreate" else 2), proc.stderr
    assert _gone(pids), f"rank processes still alive after {mode}"


def test_rank_that_died_while_idle_is_replaced(cluster2):
    cluster2.run(jobs.hello)
    os.kill(cluster2.pids[1], signal.SIGKILL)
    time.sleep(0.5)
    assert "broken" in repr(cluster2)
    with pytest.warns(RuntimeWarning, match="rank 1 .* exited while the cluster was idle"):
        assert cluster2.run(jobs.hello).outputs[1]["rank_sum"] == 1.0


def test_edited_job_module_is_reloaded_on_warm_ranks(cluster2, tmp_path, monkeypatch):
    mod = tmp_path / "editable_job_mod.py"
    mod.write_text("def job(ctx, cfg):\n    return 'first'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import editable_job_mod
    cluster2.restart()  # the ranks must see tmp_path on sys.path: start them after it is set
    old = cluster2.run(editable_job_mod.job).outputs
    time.sleep(1.1)  # a new mtime, even on filesystems with 1 s resolution
    mod.write_text("def job(ctx, cfg):\n    return 'second'\n")
    editable_job_mod = importlib.reload(editable_job_mod)
    assert old == ["first", "first"]
    assert cluster2.run(editable_job_mod.job).outputs == ["second", "second"]
