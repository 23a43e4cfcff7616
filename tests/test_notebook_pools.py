"""Run All three times in one kernel leaves one pool: exactly ``world_size`` rank processes.

The tour creates ``Cluster(4)``, a timeline and an explorer that holds the cluster; the
widget registry keeps every explorer (and so every old cluster) alive for the kernel's
life. Each Run All must still stop the previous pool.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1500)]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


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


def test_tour_run_all_three_times_leaves_world_size_ranks():
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / "00_tour.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    counts = []
    with client.setup_kernel():
        pid = client.km.provisioner.process.pid
        for _ in range(3):
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
            counts.append(len(rank_processes(pid)))
        check = nbformat.v4.new_code_cell("print(sorted(cluster.pids))")
        nb.cells.append(check)
        client.execute_cell(check, len(nb.cells) - 1)
        current = check.outputs[0]["text"].strip()
        ranks = sorted(rank_processes(pid))
    print(f"rank processes after each Run All: {counts}")
    assert counts == [4, 4, 4], counts
    assert current == str(ranks)  # the four left are the current cluster's
