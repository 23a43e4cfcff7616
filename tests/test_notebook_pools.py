"""Run All three times in one kernel leaves one pool: exactly ``world_size`` rank processes.

A notebook like the tour creates ``Cluster(4)``, makes a rank fail (the pool restarts with
new processes) and shows an explorer that holds the cluster; the widget registry keeps
every explorer (and so every old cluster) alive for the kernel's life. Each Run All must
still stop the previous pool, including one that a failed job restarted. The notebook here
has only the cells that start, restart or hold a pool (the tour's other cells run their
jobs on it and start nothing; nbval runs the tour itself once), and its job fails in the
first Run All only (that restarted pool is the one the second Run All replaces), so Run
All x3 costs three starts and one restart, not three runs of the whole tour. Two ranks, where
the tour has four: which pool is current, and so which processes a Run All stops, does not
depend on the pool's size, and each start of two ranks costs half the CPU of four.
"""
from __future__ import annotations

import nbformat
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(900)]

#: the tour's pool cells, on two ranks: the cluster, a failing job (the pool restarts;
#: first Run All only), an explorer holding the cluster and running one tiny job on it
CELLS = [
    "import labkit as lk\nfrom labkit_widgets import Explorer",
    "cluster = lk.Cluster(world_size=2)\nprint(cluster)",
    "if 'explorer' not in globals():\n    try:\n        cluster.run(lk.jobs.fail, 1)\n"
    "    except lk.RankError as err:\n        print(f'RankError from rank {err.rank}')",
    "explorer = Explorer(cluster, lk.RunConfig(model='tiny', steps=1, global_batch=8)"
    ".replace(dp=2))\nexplorer",
]


def rank_processes(root_pid: int) -> list:
    """Rank processes (spawn children, not multiprocessing's resource tracker) under a pid."""
    out = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "spawn_main" in cmd and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_run_all_three_times_leaves_world_size_ranks(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in CELLS])
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    counts, restarted = [], []
    with client.setup_kernel():
        pid = client.km.provisioner.process.pid
        for _ in range(3):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
            counts.append(len(rank_processes(pid)))
            restarted.append("".join(o.get("text", "") for o in nb.cells[2].outputs).strip())
        check = nbformat.v4.new_code_cell("print(sorted(cluster.pids), cluster.restarts, "
                                          "len(explorer.history))")
        nb.cells.append(check)
        client.execute_cell(check, len(nb.cells) - 1)
        current = check.outputs[0]["text"].strip()
        ranks = sorted(rank_processes(pid))
    print(f"rank processes after each Run All: {counts}")
    assert restarted == ["RankError from rank 1", "", ""]  # the first pool was restarted
    assert counts == [2, 2, 2], counts
    assert current == f"{ranks} 0 1"  # the two left are the current cluster's
