"""Stragglers: a rank that is slow shows up as everyone else waiting for it.

In a synchronous collective the ranks that arrive first wait for the last one, so a slow
rank (throttled, a noisy neighbour, a failing fan) does not look slow itself: its peers'
all-reduce spans grow. :func:`stragglers` reads a run's trace (:class:`labkit.trace.Trace`)
and, for each collective, each rank's *lateness*: when it entered minus when the earliest
other member entered. A straggler is late at most collectives; the others are early.

Bound: a straggler is named in the result of the run it slowed (every collective it
delayed is in the trace), from the first step it slowed.

Live: :func:`live_stragglers` reads the same lateness from the flight records
(:mod:`.recorder`) while the job runs; :class:`labkit.Cluster` polls it every 0.25 s for a
job whose config sets ``straggler_s`` and reports each straggler once per job
(:attr:`labkit.Cluster.faults`, ``RunResult.faults``, and a line on stderr), without
stopping the job.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from ..trace import COMM

__all__ = ["StragglerReport", "stragglers", "LiveStraggler", "live_stragglers"]


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


# -- live, on the cluster's side ----------------------------------------------------------
#: steps of a group looked at (the latest ones)
WINDOW = 4
#: of those, in how many a rank must have kept its peers waiting more than ``threshold_s``
MIN_LATE = 3


@dataclass
class LiveStraggler:
    """A straggler seen while the job runs (:func:`live_stragglers`).

    Attributes:
        rank: the slow rank.
        group: the group whose collectives it delays.
        late_s: median over its late steps of the longest its peers waited for it in one
            collective of the step (seconds).
        late: in how many of the last ``window`` steps it kept them waiting that long.
        window: steps looked at.
        op, seq, step: the collective it was latest to in its latest late step, the
            collective's sequence number in the group, and the step.
        steps_behind: the furthest peer's current step minus the straggler's (0 when the
            collectives keep them in lock-step).
        t_seen: ``perf_counter`` at which it entered the collective that decided it (the
            earliest moment it could have been detected).
    """

    rank: int
    group: tuple
    late_s: float
    late: int
    window: int
    op: str
    seq: int
    step: int
    steps_behind: int
    t_seen: float

    def __str__(self) -> str:
        return (f"rank {self.rank} is a straggler: in {self.late} of the last {self.window} "
                f"steps its peers on group {list(self.group)} waited for it, a median "
                f"{self.late_s * 1e3:.0f} ms (latest: {self.op} #{self.seq} in step "
                f"{self.step}; {self.steps_behind} step(s) behind its furthest peer)")


def live_stragglers(by_rank: dict, threshold_s: float, window: int = WINDOW,
                    min_late: int = MIN_LATE) -> list:
    """Stragglers from the flight records of a running job (``{rank: RankRecords}``,
    :mod:`.recorder`).

    For every collective all members of its group entered, the member that entered last
    kept the others waiting ``its entry − the earliest other entry``; per step (per
    collective for a job that numbers no steps) a rank's lateness is the longest such
    wait it caused. A rank late by more than ``threshold_s`` in at least ``min_late`` of
    the group's last ``window`` steps is a straggler. Pure: every time comes from the
    records, so a test drives it with records of any timing.

    Bound: the cluster polls every 0.25 s, so a straggler is reported within one poll of
    entering, late, the collective of its ``min_late``-th late step (``t_seen``).

    Raises:
        ValueError: ``threshold_s`` not > 0, or ``min_late`` not in ``1 … window``.
    """
    if not threshold_s > 0:
        raise ValueError(f"threshold_s must be > 0, got {threshold_s!r}")
    if not 1 <= min_late <= window:
        raise ValueError(f"min_late={min_late} must be between 1 and window={window}")
    entries: dict = defaultdict(dict)  # (group, seq) -> {rank: record}
    for r, rr in by_rank.items():
        for x in (rr.records if rr is not None else ()):
            if len(x.group) > 1:
                entries[(x.group, x.seq)][r] = x
    found: dict = {}
    for g in sorted({g for g, _ in entries}):
        units: dict = {}  # step (or -1 - seq) -> {rank: (lag, record)}, in issue order
        for (h, seq), recs in sorted(entries.items(), key=lambda kv: kv[0][1]):
            if h != g or len(recs) < len(g):
                continue
            r = max(recs, key=lambda q: recs[q].t_enter)
            lag = recs[r].t_enter - min(x.t_enter for q, x in recs.items() if q != r)
            step = recs[r].step
            u = units.setdefault(step if step >= 0 else -1 - seq, {})
            if lag > u.get(r, (0.0, None))[0]:
                u[r] = (lag, recs[r])
        last = list(units.values())[-window:]
        late: dict = defaultdict(list)
        for u in last:
            for r, (lag, x) in u.items():
                if lag > threshold_s:
                    late[r].append((lag, x))
        for r, lags in late.items():
            if len(lags) < min_late or r in found:
                continue
            x = lags[-1][1]
            steps = [rr.step for q, rr in by_rank.items() if q in g and rr is not None]
            found[r] = LiveStraggler(r, g, statistics.median(v for v, _ in lags), len(lags),
                                     len(last), x.op, x.seq, x.step,
                                     max(0, max(steps) - by_rank[r].step),
                                     lags[min_late - 1][1].t_enter)
    return [found[r] for r in sorted(found)]
