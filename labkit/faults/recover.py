"""Run a job through its faults: detect, restart the pool, run again (from the last
checkpoint when asked), and account for what each fault cost.

:func:`run_resilient` is the loop an on-call engineer runs by hand: a
:class:`~labkit.faults.watch.RankDied`, :class:`~labkit.faults.watch.CollectiveHang`, a
rank's error or a timeout ends the attempt; the cluster has already killed the ranks and
started a fresh pool (:class:`labkit.Cluster`); the next attempt waits for that pool,
and runs the config again without the injected faults (they were injected once). With
``resume=True`` the next attempt resumes from the last snapshot (:mod:`labkit.snapshot`:
``save_dir``, ``save_every``, ``resume``); without ``save_dir`` it refuses before running
anything.

Each fault's cost is measured, as Young and Daly model it (:mod:`.goodput`): the time to
detect it, the time to recover (detection → restarted pool ready), and the work lost
(steps since the last checkpoint × the measured step time).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..result import RankError, RunResult
from .goodput import FaultCost, measured_goodput

__all__ = ["run_resilient", "ResilientRun", "resume_config"]


@dataclass
class ResilientRun:
    """What :func:`run_resilient` returns.

    Attributes:
        result: the last, successful attempt's :class:`~labkit.result.RunResult`.
        faults: one :class:`~labkit.faults.goodput.FaultCost` per failed attempt.
        errors: the exception each failed attempt raised, as text (first line).
        wall_s: seconds from the first dispatch to the last result.
        useful_s: the kept work: ``steps ×`` the mean step time of the successful attempt.
    """

    result: RunResult
    faults: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    wall_s: float = 0.0
    useful_s: float = 0.0

    @property
    def goodput(self) -> float:
        """Kept work over wall time (0–1)."""
        return measured_goodput(self.useful_s, self.wall_s)

    def __repr__(self) -> str:
        return (f"ResilientRun({len(self.faults)} fault(s), wall {self.wall_s:.2f} s, "
                f"goodput {self.goodput:.2f})")


def resume_config(cfg, fault_step: int) -> tuple:
    """``(the config of the next attempt, the step it restarts from)`` when resuming from
    the last checkpoint: the hook distributed checkpoints plug into.

    ``fault_step`` is the step the fault struck (its work is lost); snapshots are written
    after every ``save_every`` steps, so the run resumes at the last multiple of
    ``save_every`` at or below it (from step 0, ``resume=False``, when there is none). The
    snapshot folder must hold only this run's snapshots: the latest one is loaded.

    Raises:
        ValueError: ``cfg`` has no checkpoint fields (``save_dir``/``save_every``/``resume``)
            or ``save_dir`` is not set.
    """
    if not all(hasattr(cfg, f) for f in ("save_dir", "save_every", "resume")):
        raise ValueError("resume=True needs snapshots (RunConfig.save_dir, save_every, "
                         "resume: labkit.snapshot); run with resume=False to restart from "
                         "step 0")
    if not cfg.save_dir:
        raise ValueError("resume=True needs save_dir set: there is no checkpoint to resume")
    every = cfg.save_every or 0
    # a snapshot is written after every ``save_every`` steps: the last one before the
    # fault's step is the one to resume; none yet means starting over
    start = (max(fault_step, 0) // every) * every if every else 0
    return dataclasses.replace(cfg, resume=start > 0), start


def run_resilient(cluster, cfg, job: Any = None, *, max_restarts: int = 2,
                  resume: bool = False,
                  on_fault: Optional[Callable[[FaultCost, BaseException], None]] = None
                  ) -> ResilientRun:
    """Run ``job`` (default :func:`labkit.jobs.train`) on ``cluster`` until it succeeds,
    at most ``max_restarts`` restarts.

    Args:
        cluster: a :class:`labkit.Cluster`.
        cfg: the run's config; its ``fault`` is injected into the first attempt only.
        resume: resume each later attempt from the last checkpoint (:func:`resume_config`)
            instead of step 0.
        on_fault: called with each fault's cost and exception as it is detected (a
            notebook prints them); its ``lost_s`` is filled in when the run ends.

    Raises:
        ValueError: ``resume=True`` without checkpoint fields, before anything runs.
        the last attempt's exception, when ``max_restarts`` restarts did not suffice.
    """
    from .. import jobs

    job = job or jobs.train
    if resume:
        resume_config(cfg, 0)  # refuse before running anything
    out = ResilientRun(None)
    t_start = time.perf_counter()
    attempt = cfg
    restart_from = 0
    for n in range(max_restarts + 1):
        try:
            res = cluster.run(job, attempt)
        except (RankError, TimeoutError) as exc:
            if n == max_restarts:
                raise
            event = cluster.current.faults[-1] if cluster.current.faults else None
            detected = event.detected_at if event else time.perf_counter()
            step = event.step if event else -1
            cluster.current._wait_ready()  # the pool the cluster restarted on detection
            recovered = time.perf_counter()
            attempt = dataclasses.replace(cfg, fault=None)
            if resume:
                attempt, restart_from = resume_config(attempt, step)
            cost = FaultCost(event.kind if event else type(exc).__name__,
                             event.rank if event else None, step,
                             event.detect_s if event else None, recovered - detected,
                             0.0, max(step, 0) - restart_from)
            out.faults.append(cost)
            out.errors.append(str(exc).strip().splitlines()[0])
            if on_fault is not None:
                on_fault(cost, exc)
            continue
        out.result = res
        break
    out.wall_s = time.perf_counter() - t_start
    step_s = _step_time(out.result)
    for c in out.faults:
        c.lost_s = c.lost_steps * step_s
    out.useful_s = step_s * getattr(cfg, "steps", 0)
    return out


def _step_time(result) -> float:
    """Mean step seconds of the successful attempt's timed steps (the slowest rank's: all
    ranks step together). The mean, not the median, so that ``steps ×`` it is the time the
    steps took even when some were slower (a straggler's)."""
    means = []
    for m in (result.metrics if result is not None else []):
        times = [t for t in m.get("step_times", []) if t == t]
        if times:
            means.append(sum(times) / len(times))
    return max(means) if means else 0.0
