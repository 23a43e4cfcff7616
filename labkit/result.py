"""What a cluster run gives back: ``RunResult``; ``RankError`` when a rank failed,
``JobCancelled`` when the caller interrupted it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .trace import Trace

__all__ = ["RunResult", "RankError", "JobCancelled"]


class RankError(RuntimeError):
    """A rank raised during a job. ``rank`` and ``remote_traceback`` say where and why."""

    def __init__(self, rank: int, remote_traceback: str, job: str = ""):
        self.rank, self.remote_traceback, self.job = rank, remote_traceback, job
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else ""
        super().__init__(f"rank {rank} failed in job {job}: {last}\n\n"
                         f"--- remote traceback (rank {rank}) ---\n{remote_traceback}")


class JobCancelled(KeyboardInterrupt):
    """A kernel interrupt (Ctrl-C, Kernel ▸ Interrupt) cancelled a job or a pool start.

    Still a ``KeyboardInterrupt``, so Run All stops here. What happened is one line: the
    frames inside :mod:`labkit.cluster` (waiting on pipes) say nothing to the user, so
    IPython, which asks an exception for ``_render_traceback_``, shows only the message.
    """

    def _render_traceback_(self) -> list:
        return [f"KeyboardInterrupt: {self}"]


@dataclass
class RunResult:
    """What one ``Cluster.run`` returns.

    Attributes:
        config: the config the job ran with.
        outputs: each job rank's return value, indexed by rank.
        trace: all ranks' events merged (:class:`labkit.trace.Trace`).
        wall_s: seconds from dispatch to the last result, in the caller.
        faults: what the cluster saw while the job ran and let it finish (live stragglers:
            :class:`labkit.faults.watch.FaultEvent` s of kind ``"straggler"``).
    """

    config: Any
    outputs: list
    trace: Trace
    wall_s: float
    job: str = ""
    faults: list = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.outputs)

    @property
    def metrics(self) -> list:
        """Per-rank ``output["metrics"]`` for jobs that return a dict with that key."""
        return [o.get("metrics", {}) if isinstance(o, dict) else {} for o in self.outputs]

    @property
    def losses(self) -> list:
        """Rank 0's per-step losses, for jobs that return ``{"losses": [...]}``."""
        out = self.outputs[0] if self.outputs else None
        return list(out.get("losses", [])) if isinstance(out, dict) else []

    def __repr__(self) -> str:
        return (f"RunResult(job={self.job}, ranks={self.world_size}, wall={self.wall_s:.3f} s, "
                f"{self.trace!r})")
