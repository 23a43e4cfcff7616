"""Starting a pool's rank processes, and saying where a start stopped when it fails.

:func:`spawn_ranks` starts ``world_size`` processes with the *spawn* method, each running
:func:`labkit.worker.worker_main` over its own pipe. Each rank reports its progress:

=============  ==================================================================
``spawned``    the process exists (the parent knows this without a message)
``started``    Python runs labkit's worker; next it imports torch (the slow part)
``joining``    torch is imported; it is inside ``init_process_group``
``ready``      it joined the process group and waits for jobs
=============  ==================================================================

:class:`Startup` keeps that record for one pool and turns a failure into an error that
names each rank's stage: a rank that raised or died while starting, the start timeout, or
ranks that all reached ``init_process_group`` and still have not formed a group after
:data:`JOIN_TIMEOUT_S` (a local ``FileStore`` rendezvous takes well under a second, so
waiting for the whole start timeout would only make the next click wait for nothing).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import types
from typing import Optional

from .result import RankError

__all__ = ["JOIN_TIMEOUT_S", "STAGES", "Startup", "spawn_ranks"]

#: seconds ranks may spend in init_process_group once every pending rank got there
JOIN_TIMEOUT_S = 30.0
#: what each stage means, as error messages say it
STAGES = {"spawned": "starting Python", "started": "importing torch",
          "joining": "joining the process group (init_process_group)", "ready": "ready"}
_RESTART = "the ranks were stopped; the next run starts fresh ones"


def spawn_ranks(world_size: int, backend: str, device: str, threads: int,
                nodes: Optional[list] = None) -> tuple:
    """Start the rank processes of one pool; returns ``(procs, parent pipe ends, tmp dir)``.

    The ranks meet through a ``FileStore`` in the new temporary folder (no port opened).
    ``nodes``: each rank's :class:`labkit.nodes.NodeSpec` (emulated nodes), or ``None``.
    """
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="labkit-")
    store = os.path.join(tmp, "store")
    procs, conns = [], []
    with _main_hidden():
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_entry, name=f"labkit-rank{rank}", daemon=True,
                            args=(rank, world_size, store, backend, device, threads,
                                  child_end, os.getpid(), list(sys.path),
                                  nodes[rank] if nodes else None))
            p.start()
            child_end.close()
            conns.append(parent_end)
            procs.append(p)
    return procs, conns, tmp


class Startup:
    """The startup record of one pool: which ranks are pending, and at what stage.

    Args:
        world_size: ranks in the pool.
        timeout_s: seconds from now the whole start may take.
    """

    def __init__(self, world_size: int, timeout_s: float):
        self.pending = set(range(world_size))
        self.stage = ["spawned"] * world_size
        self.info: list = [None] * world_size
        self.timeout_s = timeout_s
        self.deadline = time.perf_counter() + timeout_s
        self._all_joining_at: Optional[float] = None

    def note(self, kind: str, rank: int, payload) -> None:
        """Record a ``"progress"`` or ``"ready"`` message from ``rank``."""
        if kind == "progress":
            self.stage[rank] = payload
            if all(self.stage[r] == "joining" for r in self.pending):
                self._all_joining_at = time.perf_counter()
        elif kind == "ready":
            self.info[rank] = payload
            self.stage[rank] = "ready"
            self.pending.discard(rank)

    def overdue(self, now: float) -> Optional[TimeoutError]:
        """The error to raise when the start has gone on too long, else ``None``."""
        pending, where = sorted(self.pending), self.where(self.pending)
        if (self._all_joining_at is not None and self.pending
                and now - self._all_joining_at > JOIN_TIMEOUT_S):
            return TimeoutError(f"ranks {pending} reached init_process_group but the process "
                                f"group did not form within {JOIN_TIMEOUT_S:.0f} s ({where}); "
                                f"{_RESTART}")
        if now >= self.deadline and self.pending:
            return TimeoutError(f"ranks {pending} did not start within {self.timeout_s} s "
                                f"({where}); {_RESTART}")
        return None

    def failed(self, rank: int, detail: str) -> RankError:
        """The error for ``rank`` raising or dying while starting, with its stage."""
        return RankError(rank, f"while {STAGES.get(self.stage[rank], self.stage[rank])}:\n"
                               f"{detail}", f"startup ({_RESTART})")

    def where(self, ranks) -> str:
        """``"rank 0 still joining …; ranks 1, 2 still importing torch"``."""
        by: dict = {}
        for r in sorted(ranks):
            by.setdefault(STAGES.get(self.stage[r], self.stage[r]), []).append(r)
        return "; ".join(f"rank{'s' if len(v) > 1 else ''} {', '.join(map(str, v))} still {k}"
                         for k, v in by.items())


@contextlib.contextmanager
def _main_hidden():
    """Start ranks without re-running the caller's ``__main__``.

    The spawn method normally re-imports the parent's main module in each child, which
    re-runs an unguarded script (and its ``Cluster(...)`` line) in every rank. Jobs are
    imported by name, so ranks never need ``__main__``: a bare stand-in is shown to
    multiprocessing while the processes are created.
    """
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def _worker_entry(*args) -> None:
    from .worker import worker_main

    worker_main(*args)
