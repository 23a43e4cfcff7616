"""Stragglers: a rank that is slow shows up as everyone else waiting for it.

In a synchronous collective the ranks that arrive first wait for the last one, so a slow
rank (throttled, a noisy neighbour, a failing fan) does not look slow itself: its peers'
all-reduce spans grow. :func:`stragglers` reads a run's trace (:class:`labkit.trace.Trace`)
and, for each collective, each rank's *lateness*: when it entered minus when the earliest
other member entered. A straggler is late at most collectives; the others are early.

Bound: a straggler is named in the result of the run it slowed (every collective it
delayed is in the trace), from the first step it slowed.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from ..trace import COMM

__all__ = ["StragglerReport", "stragglers"]


@dataclass
class StragglerReport:
    """``lateness_s``: per rank, the median seconds it entered collectives after the
    earliest other member; ``last_share``: per rank, the share of collectives it entered
    last; ``slow``: ranks whose median lateness exceeds the threshold, latest first."""

    lateness_s: dict
    last_share: dict
    slow: list
    threshold_s: float
    collectives: int

    def __str__(self) -> str:
        if not self.slow:
            return (f"no straggler: no rank entered its collectives a median "
                    f"{self.threshold_s * 1e3:.0f} ms after the others "
                    f"({self.collectives} collectives)")
        return "; ".join(f"rank {r} is a straggler: it entered collectives a median "
                         f"{self.lateness_s[r] * 1e3:.0f} ms after the earliest other rank, "
                         f"last at {self.last_share[r]:.0%} of {self.collectives}"
                         for r in self.slow)


def stragglers(trace, threshold_s: float = 0.05, from_step: int = 0) -> StragglerReport:
    """Name the slow ranks of a run from its collectives.

    Args:
        trace: the run's :class:`~labkit.trace.Trace`.
        threshold_s: median lateness above which a rank is a straggler.
        from_step: ignore collectives of earlier steps (the first step builds caches).

    Raises:
        ValueError: ``threshold_s`` not > 0.
    """
    if not threshold_s > 0:
        raise ValueError(f"threshold_s must be > 0, got {threshold_s!r}")
    seen: dict = defaultdict(int)
    entries: dict = defaultdict(dict)
    for e in trace.events:  # sorted by start: the n-th of a group on each rank matches
        if e.cat != COMM or e.step < from_step or len(e.peers) < 2:
            continue
        key = (e.rank, e.peers, e.op)
        entries[(e.peers, e.op, seen[key])][e.rank] = e.start
        seen[key] += 1
    late: dict = defaultdict(list)
    last: dict = defaultdict(int)
    n = 0
    for starts in entries.values():
        if len(starts) < 2:
            continue
        n += 1
        for r, t in starts.items():
            late[r].append(t - min(v for q, v in starts.items() if q != r))
        last[max(starts, key=starts.get)] += 1
    lateness = {r: statistics.median(v) for r, v in sorted(late.items())}
    share = {r: last[r] / max(1, len(late[r])) for r in lateness}
    slow = sorted((r for r, v in lateness.items() if v > threshold_s),
                  key=lambda r: -lateness[r])
    return StragglerReport(lateness, share, slow, threshold_s, n)
