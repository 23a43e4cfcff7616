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
from dataclasses import dataclass, field

from ..trace import COMM

__all__ = ["StragglerReport", "stragglers"]


@dataclass
class StragglerReport:
    """``lateness_s``: per rank, the median seconds it entered collectives after the
    earliest other member; ``last_share``: per rank, the share of collectives it entered
    last (``last_count`` of them); ``worst``: per rank, ``(seconds, step, op)`` of the
    collective it entered latest; ``slow``: ranks whose median lateness exceeds the
    threshold, latest first; ``collectives``: how many collectives (of two or more ranks,
    from step ``from_step`` on) were compared."""

    lateness_s: dict
    last_share: dict
    slow: list
    threshold_s: float
    collectives: int
    last_count: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    from_step: int = 0

    def __str__(self) -> str:
        since = f"from step {self.from_step} on" if self.from_step else "in the run"
        if not self.slow:
            return (f"no straggler: no rank entered its collectives a median "
                    f"{self.threshold_s * 1e3:.0f} ms or more after the others "
                    f"({self.collectives} collectives {since})")
        others = "the other rank" if len(self.lateness_s) == 2 else "the earliest other rank"
        lines = []
        for r in self.slow:
            s, step, op = self.worst[r]
            lines.append(f"rank {r} is a straggler: the last to enter {self.last_count[r]} of "
                         f"the {self.collectives} collectives {since},\n"
                         f"  a median {self.lateness_s[r] * 1e3:.0f} ms after {others}; "
                         f"at its latest (step {step}'s {op}) {s * 1e3:.0f} ms after")
        return "\n".join(lines)


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
    steps: dict = {}
    for e in trace.events:  # sorted by start: the n-th of a group on each rank matches
        if e.cat != COMM or e.step < from_step or len(e.peers) < 2:
            continue
        key = (e.rank, e.peers, e.op)
        entries[(e.peers, e.op, seen[key])][e.rank] = e.start
        steps.setdefault((e.peers, e.op, seen[key]), e.step)
        seen[key] += 1
    late: dict = defaultdict(list)
    last: dict = defaultdict(int)
    worst: dict = {}
    n = 0
    for k, starts in entries.items():
        if len(starts) < 2:
            continue
        n += 1
        for r, t in starts.items():
            d = t - min(v for q, v in starts.items() if q != r)
            late[r].append(d)
            if r not in worst or d > worst[r][0]:
                worst[r] = (d, steps[k], k[1])
        last[max(starts, key=starts.get)] += 1
    lateness = {r: statistics.median(v) for r, v in sorted(late.items())}
    share = {r: last[r] / max(1, len(late[r])) for r in lateness}
    slow = sorted((r for r, v in lateness.items() if v > threshold_s),
                  key=lambda r: -lateness[r])
    return StragglerReport(lateness, share, slow, threshold_s, n,
                           {r: last[r] for r in lateness}, worst, from_step)
