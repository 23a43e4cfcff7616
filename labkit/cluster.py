"""``Cluster``: a warm pool of rank processes that runs jobs from a notebook cell.

Starting ranks costs seconds (each imports torch); running a job on warm ranks costs
milliseconds. So a cluster starts ``world_size`` processes once and keeps them, each with
its process group initialised, and ``run`` ships (job, config) to them over pipes.

Faults never hang the caller: a rank that raises becomes :class:`RankError` carrying the
remote traceback, a job past its timeout becomes ``TimeoutError``, a kernel interrupt
cancels the job; in each case the ranks are killed and a fresh pool starts in the
background, so the next ``run`` works.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import types
import warnings
import weakref
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Optional, Union

from .preflight import check_run_fits, check_world_size
from .result import RankError, RunResult
from .trace import Trace
from .worker import check_config, job_reference

__all__ = ["Cluster", "RunResult", "RankError", "job_reference"]

_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


class Cluster:
    """A warm pool of ``world_size`` rank processes.

    Args:
        world_size: number of rank processes.
        backend: ``"auto"`` (NCCL with one GPU per rank when
            ``torch.cuda.device_count() >= world_size``, else gloo), ``"gloo"`` or ``"nccl"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``; follows the backend when ``"auto"``.
        timeout_s: default seconds a job may run before ``TimeoutError``.
        start_timeout_s: seconds the ranks may take to start and join the group.
        threads_per_rank: torch intra-op threads per rank; default cores // world_size
            (at least 1), so ranks do not oversubscribe the CPU.

    Raises:
        ValueError: a bad world size, backend or device, before any process starts.
    """

    def __init__(self, world_size: int = 4, backend: str = "auto", device: str = "auto",
                 timeout_s: float = 300.0, start_timeout_s: float = 120.0,
                 threads_per_rank: Optional[int] = None):
        import torch

        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if backend == "auto":
            backend = "nccl" if (device != "cpu" and gpus >= world_size) else "gloo"
        if device == "auto":
            device = "cuda" if backend == "nccl" else "cpu"
        if (backend == "nccl" or device == "cuda") and gpus < world_size:
            raise ValueError(f"backend={backend!r}/device={device!r} needs one GPU per rank: "
                             f"world_size={world_size} but {gpus} GPU(s) are visible")
        if backend == "nccl" and device != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda'")
        if backend == "gloo" and device != "cuda":
            check_world_size(world_size)  # CPU ranks: at most a few per core
        self.world_size, self.backend, self.device = world_size, backend, device
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._procs: list = []
        self._conns: list = []
        self._tmp: Optional[str] = None
        self._ready = False
        self._ids = itertools.count()
        self.info: list = []
        self.restarts = 0
        self._start()
        _LIVE.add(self)

    # -- lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="labkit-")
        store = os.path.join(self._tmp, "store")
        self._conns, self._procs = [], []
        with _main_hidden():
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_worker_entry, name=f"labkit-rank{rank}", daemon=True,
                                args=(rank, self.world_size, store, self.backend, self.device,
                                      self.threads_per_rank, child_end, os.getpid(),
                                      list(sys.path)))
                p.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(p)
        self._ready = False
        self._started_at = time.perf_counter()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        self.info = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = self._started_at + self.start_timeout_s
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                self._kill()
                raise TimeoutError(f"ranks {sorted(pending)} did not start within "
                                   f"{self.start_timeout_s} s")
            kind, rank, payload = self._next_message(pending, left)
            if kind is None:
                continue
            if kind == "ready":
                self.info[rank] = payload
                pending.discard(rank)
            elif kind == "error":
                self._kill()
                self._start()
                raise RankError(rank, payload, "startup")
        self._ready = True

    def _next_message(self, ranks, timeout):
        """One (kind, rank, payload) from ``ranks``' pipes; a dead rank is an error."""
        conns = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks}
        ready = mp_wait(list(conns) + list(sentinels), timeout)
        for obj in ready:
            if obj in conns:
                try:
                    kind, _job, rank, payload = obj.recv()
                    return kind, rank, payload
                except (EOFError, OSError):
                    return "error", conns[obj], self._death_note(conns[obj])
        for obj in ready:
            if obj in sentinels and not self._conns[sentinels[obj]].poll():
                return "error", sentinels[obj], self._death_note(sentinels[obj])
        return None, None, None

    def _death_note(self, r: int) -> str:
        p = self._procs[r]
        p.join(timeout=1)
        return (f"rank process {r} (pid {p.pid}) died with exit code {p.exitcode} before "
                "reporting (killed, out of memory, or crashed in native code)")

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns, self._ready = [], [], False
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def restart(self) -> None:
        """Kill the ranks and start a fresh pool (non-blocking; the next run waits)."""
        self._kill()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        """Stop every rank process. Safe to call twice."""
        for c in self._conns:
            try:
                c.send(("close", None))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.perf_counter() + 3.0  # one budget for all ranks, then kill
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.perf_counter()))
        self._kill()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = ("closed" if not self._procs else "starting" if not self._ready
                 else "warm" if self.alive else "broken: a rank exited; the next run restarts")
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device!r}, {state})")

    # -- running jobs ------------------------------------------------------------------
    def run(self, job: Union[Callable, str], config: Any = None, *, nranks: Optional[int] = None,
            timeout_s: Optional[float] = None) -> RunResult:
        """Run ``job(ctx, config)`` on ranks ``0 … nranks−1``; the rest wait.

        Args:
            job: a module-level function (or ``"module:function"``) importable by the ranks.
            config: a picklable config. If it has ``validate(world_size)`` that runs first,
                in the caller. ``nranks`` defaults to ``config.parallel.world_size`` when
                the config has one, else the whole cluster.
            timeout_s: seconds before the job is cancelled; default ``config.timeout_s`` or
                the cluster's.

        Raises:
            TypeError: the job is not importable by the ranks, the config is not of the class
                the job's config parameter is annotated with, or it is not picklable.
            ValueError: the config is invalid for this cluster (from its ``validate``), or
                (CPU ranks) its model state cannot fit the memory this machine has now.
            RankError: a rank raised; the pool is restarted.
            TimeoutError: the job ran too long; the pool is restarted.
        """
        module, qualname = job_reference(job)
        check_config(job, config)
        if hasattr(config, "validate"):
            config.validate(self.world_size)
            if self.backend == "gloo" and getattr(config, "mesh", None) is not None:
                check_run_fits(config)  # the model fits this machine's memory, as on the CLI
        if nranks is None:
            par = getattr(config, "parallel", None)
            nranks = getattr(par, "world_size", None) or self.world_size
        if not 1 <= nranks <= self.world_size:
            raise ValueError(f"nranks={nranks} must be between 1 and the cluster's "
                             f"world_size={self.world_size}")
        if type(config).__module__ in ("__main__", "__mp_main__"):
            raise TypeError(f"config of type {type(config).__name__} is defined in __main__ "
                            "(a notebook cell), so ranks cannot unpickle it; define it in an "
                            "importable .py file or use labkit.config.RunConfig")
        try:
            pickle.dumps(config)
        except Exception as exc:
            raise TypeError(f"config of type {type(config).__name__} cannot be sent to the "
                            f"ranks: it is not picklable ({exc})") from None
        timeout_s = timeout_s or getattr(config, "timeout_s", None) or self.timeout_s
        if not self._procs:
            self._start()
        elif self._ready and not self.alive:
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self._procs)
                    if not p.is_alive()]
            warnings.warn(f"labkit: {', '.join(dead)} exited while the cluster was idle; "
                          "restarting the pool before this run", RuntimeWarning, stacklevel=2)
            self.restart()
        name = f"{module}.{qualname}"
        try:
            self._wait_ready()
            job_id = next(self._ids)
            t0 = time.perf_counter()
            for c in self._conns:
                c.send(("run", job_id, module, qualname, config, nranks))
            outputs, events = self._collect(job_id, name, t0 + timeout_s, timeout_s)
        except KeyboardInterrupt:
            self.restart()
            raise
        return RunResult(config, [outputs[r] for r in range(nranks)], Trace.merge(events),
                         time.perf_counter() - t0, name)

    def _collect(self, job_id, name, deadline, timeout_s):
        outputs, events = {}, []
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                self.restart()
                raise TimeoutError(f"job {name} did not finish within {timeout_s} s on ranks "
                                   f"{sorted(pending)}; the cluster was restarted")
            kind, rank, payload = self._next_message(pending, min(left, 0.5))
            if kind == "result":
                outputs[rank] = payload["output"]
                events.append(payload["events"])
                pending.discard(rank)
            elif kind == "idle":
                pending.discard(rank)
            elif kind == "error":
                self.restart()
                raise RankError(rank, payload, name)
        return outputs, events


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


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        try:
            c._kill()
        except Exception:
            pass
