"""Running one job on a :class:`~labkit.cluster.Cluster`'s warm ranks: ship (job, config)
down the pipes, collect every rank's output and trace, and turn a failure into one error.

A rank that raised is :class:`~labkit.result.RankError` (its traceback), a dead rank
process is :class:`~labkit.faults.watch.RankDied`, ranks stuck in one collective past
``watchdog_s`` are :class:`~labkit.faults.watch.CollectiveHang`, a job past its timeout is
``TimeoutError`` and a kernel interrupt is :class:`~labkit.result.JobCancelled`; each
restarts the pool. :class:`JobRunner` is :class:`~labkit.cluster.Cluster`'s base: it uses
the pool's pipes, processes and lifecycle methods that ``Cluster`` defines.
"""
from __future__ import annotations

import pickle
import sys
import time
import warnings
from typing import Any, Callable, Optional, Union

from .config import RunConfig
from .faults.watch import CollectiveHang, FaultEvent, RankDied, Watch
from .preflight import check_run_fits
from .result import JobCancelled, RankError, RunResult
from .trace import Trace, unpack_events
from .validate import ConfigError
from .worker import check_config, job_reference

__all__ = ["JobRunner"]


class JobRunner:
    """``run`` and its fault handling, for :class:`~labkit.cluster.Cluster`."""

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
            ConfigError: (a ``ValueError``) the config is invalid for this cluster (from its
                ``validate``), ``nranks`` is out of range, or (CPU ranks) its model state
                cannot fit the memory this machine has now.
            RankError: a rank raised; the pool is restarted.
            TimeoutError: the job ran too long, or the ranks could not start; the pool is
                restarted.
            JobCancelled: a kernel interrupt (a ``KeyboardInterrupt``) cancelled the job;
                the pool is restarted.

        A cluster that a newer ``Cluster`` of the same kind replaced runs on that one.
        """
        if self.replaced:
            return self.current.run(job, config, nranks=nranks, timeout_s=timeout_s)
        module, qualname = job_reference(job)
        check_config(job, config)
        if hasattr(config, "validate"):
            config.validate(self.world_size)
            if self.backend == "gloo" and isinstance(config, RunConfig):
                check_run_fits(config)  # the model fits this machine's memory, as on the CLI
        if nranks is None:
            par = getattr(config, "parallel", None)
            nranks = getattr(par, "world_size", None) or self.world_size
        if not 1 <= nranks <= self.world_size:
            raise ConfigError(f"nranks={nranks} must be between 1 and the cluster's "
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
        started = False
        try:
            self._wait_ready()
            job_id = next(self._ids)
            t0 = time.perf_counter()
            started = True
            for c in self._conns:
                c.send(("run", job_id, module, qualname, config, nranks))
            watch = Watch(self._tmp, self._procs, nranks, getattr(config, "watchdog_s", None),
                          getattr(config, "straggler_s", None),
                          any(i and i.get("torch_fr") for i in self.info))
            outputs, events = self._collect(job_id, name, t0 + timeout_s, timeout_s, watch)
        except KeyboardInterrupt:
            self.restart()
            what = (f"job {name} cancelled on {nranks} rank{'s' if nranks > 1 else ''}"
                    if started else f"start of {self.world_size} ranks cancelled")
            raise JobCancelled(f"{what}; pool restarting") from None
        return RunResult(config, [outputs[r] for r in range(nranks)], Trace.merge(events),
                         time.perf_counter() - t0, name, faults=list(watch.live))

    def _collect(self, job_id, name, deadline, timeout_s, watch: "Watch"):
        outputs, events = {}, []
        pending = set(range(self.world_size))
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                hang = watch.hang(force=True)
                self._fault(hang)
                self.restart()
                where = f"\n{hang.message}" if hang else ""
                raise TimeoutError(f"job {name} did not finish within {timeout_s} s on ranks "
                                   f"{sorted(pending)}; the cluster was restarted{where}")
            for slow in watch.stragglers():  # live: reported while the job goes on
                self._fault(slow)
                print(f"labkit: {slow.message}", file=sys.stderr, flush=True)
            hang = watch.hang()
            if hang is not None:  # a rank waited in a collective longer than watchdog_s
                self._fault(hang)
                self.restart()
                raise CollectiveHang(hang)
            kind, rank, payload = self._next_message(pending, min(left, watch.poll_s))
            if kind == "result":
                outputs[rank] = payload["output"]
                events.append(unpack_events(payload["events"]))
                pending.discard(rank)
            elif kind == "idle":
                pending.discard(rank)
            elif kind == "error":
                # a killed rank makes its peers' collectives fail too: name the dead one
                died = watch.death(payload)
                self._fault(died or FaultEvent("error", rank, -1, time.perf_counter(),
                                               message=payload.strip().splitlines()[-1]
                                               if payload.strip() else ""))
                self.restart()
                if died is not None:
                    raise RankDied(died, payload, name)
                raise RankError(rank, payload, name)
        return outputs, events

    def _fault(self, event) -> None:
        """Keep the last faults detected (:attr:`faults`), for goodput accounting."""
        if event is not None:
            self.faults.append(event)
            del self.faults[:-100]
