"""A pure pipeline simulator: a schedule plus F/B/W costs → timeline, bubble, memory.

Every rank runs its actions in list order; an action starts when its rank is free and its
inputs exist:

* ``F(s, m)`` needs ``F(s−1, m)`` (plus ``comm`` seconds when ``s−1`` is on another rank);
* ``B(s, m)`` / ``BW(s, m)`` need ``F(s, m)`` and the input-gradient of ``s+1`` for ``m``;
* ``W(s, m)`` needs ``B(s, m)``.

Two bubble definitions (both returned, tests say which they use):

* ``bubble`` = idle / total = Σ_r idle_r / (P · makespan), so utilisation = 1 − bubble;
  GPipe and 1F1B with unit costs give ``(P−1)/(M+P−1)`` (Huang et al. 2019 §2.2).
* ``bubble_vs_ideal`` = Σ idle / Σ busy: bubble time relative to the ideal (bubble-free)
  time; GPipe and 1F1B give ``(P−1)/M`` (Narayanan et al. 2021 §2.2.1).

Activation memory is counted in stage-microbatches: one is held on a rank from the start of
its ``F`` until its ``BW`` (or its ``W``) finishes.

Shared processors (``cores``): on a machine with fewer cores than ranks (CPU ranks on a
laptop, the lab's 2-core machine) the ranks that compute at the same moment share the cores.
With ``cores = c`` the simulator runs the operating system's ideal, processor sharing: while
``k`` ranks compute, each progresses at ``min(1, c/k)`` of full speed, so a cost is one
core's seconds of work (CPU time) and a span lasts longer when more ranks compute beside it.
``cores=None`` (the default) gives every rank its own processor, as on a GPU per rank.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from .actions import Action, Schedule

__all__ = ["simulate", "SimResult", "Span", "ScheduleError", "validate_schedule"]

Cost = Union[float, Sequence[float]]
UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}


class ScheduleError(ValueError):
    """A schedule that is incomplete, puts a stage on the wrong rank, or deadlocks."""


@dataclass(frozen=True)
class Span:
    """One simulated (or measured) compute action: seconds or cost units."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """What :func:`simulate` returns. Times are in the units of the costs.

    Attributes:
        makespan: time from the first action's start to the last one's end.
        busy, idle: per rank; ``idle[r] = makespan − busy[r]``.
        peak_inflight: per rank, the most stage-microbatch activations held at once.
        spans: every compute action with its start and end.
    """

    schedule: Schedule
    costs: dict
    makespan: float
    busy: list
    idle: list
    peak_inflight: list
    spans: list = field(repr=False)

    @property
    def bubble(self) -> float:
        """Idle / total: Σ idle / (P · makespan)."""
        return sum(self.idle) / (len(self.idle) * self.makespan) if self.makespan else 0.0

    @property
    def bubble_vs_ideal(self) -> float:
        """Bubble relative to ideal: Σ idle / Σ busy (``(P−1)/M`` for GPipe and 1F1B)."""
        return sum(self.idle) / sum(self.busy) if sum(self.busy) else 0.0

    @property
    def utilisation(self) -> float:
        return 1.0 - self.bubble

    def summary(self) -> str:
        s = self.schedule
        return (f"{s.name} P={s.pp} M={s.microbatches} V={s.virtual}: makespan "
                f"{self.makespan:.3g}, bubble {self.bubble:.1%} (idle/total), "
                f"{self.bubble_vs_ideal:.3f} (vs ideal), peak in-flight {self.peak_inflight}")


def _cost_fn(costs: Mapping[str, Cost], n_stages: int):
    def one(kind: str, stage: int) -> float:
        c = costs[kind]
        if isinstance(c, (int, float)):
            return float(c)
        if len(c) != n_stages:
            raise ValueError(f"costs[{kind!r}] has {len(c)} entries for {n_stages} stages")
        return float(c[stage])

    def cost(kind: str, stage: int) -> float:
        if kind == "BW" and "BW" not in costs:
            return one("B", stage) + one("W", stage)
        return one(kind, stage)
    return cost


def validate_schedule(sched: Schedule) -> None:
    """Check that every stage-microbatch has one ``F`` and either one ``BW`` or one ``B`` and
    one ``W``, each on the rank that holds the stage.

    Raises:
        ScheduleError: naming the first problem found.
    """
    n, m = sched.n_stages, sched.microbatches
    if len(sched.actions) != sched.pp:
        raise ScheduleError(f"{len(sched.actions)} action lists for pp={sched.pp} ranks")
    seen: dict = {}
    for r, acts in enumerate(sched.actions):
        for a in acts:
            if not a.is_compute:
                continue
            if not (0 <= a.stage < n and 0 <= a.microbatch < m):
                raise ScheduleError(f"rank {r}: action {a} is outside {n} stages x {m} "
                                    f"microbatches")
            if sched.stage_rank(a.stage) != r:
                raise ScheduleError(f"rank {r} runs {a} but stage {a.stage} lives on rank "
                                    f"{sched.stage_rank(a.stage)}")
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ScheduleError(f"{a} appears twice (ranks {seen[key]} and {r})")
            seen[key] = r
    for s in range(n):
        for i in range(m):
            if ("F", s, i) not in seen:
                raise ScheduleError(f"missing forward {Action(s, 'F', i)}")
            full, b, w = (("BW", s, i) in seen, ("B", s, i) in seen, ("W", s, i) in seen)
            if full and (b or w):
                raise ScheduleError(f"stage {s} microbatch {i} has both a full backward and "
                                    f"a split B/W")
            if not full and not (b and w):
                miss = "BW" if not (b or w) else ("W" if b else "B")
                raise ScheduleError(f"missing backward {Action(s, miss, i)}")


def _deps(a: Action, sched: Schedule, comm: float) -> list:
    s, i, n = a.stage, a.microbatch, sched.n_stages
    here = sched.stage_rank(s)
    if a.kind == "F":
        if s == 0:
            return []
        return [(("F", s - 1, i), comm if sched.stage_rank(s - 1) != here else 0.0)]
    if a.kind in ("B", "BW"):
        deps = [(("F", s, i), 0.0)]
        if s < n - 1:
            deps.append((("B", s + 1, i), comm if sched.stage_rank(s + 1) != here else 0.0))
        return deps
    return [(("B", s, i), 0.0)]  # W


def simulate(sched: Schedule, costs: Mapping[str, Cost] = UNIT, comm: float = 0.0,
             durations: Optional[Mapping[Action, float]] = None,
             dispatch: float = 0.0, cores: Optional[float] = None) -> SimResult:
    """Run ``sched`` on paper with ``costs`` = ``{"F", "B", "W"[, "BW"]}``, each a number or
    a per-stage list (``BW`` defaults to ``B + W``); ``comm`` is added to every cross-rank
    edge. Send/recv actions in a lowered schedule are ignored (their cost is ``comm``).
    ``durations`` (``{Action: seconds}``) overrides the cost of individual actions — to
    replay a measured run with its own span lengths. ``dispatch`` is the least idle time
    between two consecutive actions of one rank (a real executor's bookkeeping: posting
    messages, Python between kernels); it counts as idle, like the bubble. ``cores``: the
    ranks share that many processors (see the module docstring); ``None`` = one each.

    Raises:
        ScheduleError: incomplete schedule, a stage on the wrong rank, a rank that runs an
            action before one of its own that it depends on ("bad order"), or ranks waiting
            on each other ("deadlock"); the message names the actions.
        ValueError: ``cores`` not a finite number > 0.
    """
    validate_schedule(sched)
    cost = _cost_fn(costs, sched.n_stages)
    acts = [[a for a in rank_acts if a.is_compute] for rank_acts in sched.actions]
    p = sched.pp
    if cores is not None:
        if isinstance(cores, bool) or not isinstance(cores, numbers.Real) \
                or not math.isfinite(cores) or cores <= 0:
            raise ValueError(f"cores must be a finite number > 0 (or None), got {cores!r}")
        if cores < p:
            return _simulate_shared(sched, costs, acts, cost, comm, durations, dispatch,
                                    float(cores))
    finish: dict = {}
    free, ptr = [0.0] * p, [0] * p
    spans: list = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while ptr[r] < len(acts[r]):
                a = acts[r][ptr[r]]
                deps = _deps(a, sched, comm)
                if any(k not in finish for k, _ in deps):
                    break
                gap = dispatch if ptr[r] else 0.0
                start = max([free[r] + gap] + [finish[k] + lat for k, lat in deps])
                end = start + (durations[a] if durations and a in durations
                               else cost(a.kind, a.stage))
                spans.append(Span(r, a, start, end))
                finish[(a.kind, a.stage, a.microbatch)] = end
                if a.kind == "BW":
                    finish[("B", a.stage, a.microbatch)] = end
                free[r] = end
                ptr[r] += 1
                progress = True
    return _result(sched, costs, acts, ptr, finish, spans)


def _result(sched: Schedule, costs, acts, ptr, finish, spans) -> SimResult:
    p = sched.pp
    stuck = [r for r in range(p) if ptr[r] < len(acts[r])]
    if stuck:
        raise ScheduleError(_explain(sched, acts, ptr, stuck, finish))
    t0 = min((sp.start for sp in spans), default=0.0)
    makespan = max((sp.end for sp in spans), default=0.0) - t0
    busy = [sum(sp.end - sp.start for sp in spans if sp.rank == r) for r in range(p)]
    return SimResult(sched, dict(costs), makespan, busy, [makespan - b for b in busy],
                     peak_inflight(spans, p), sorted(spans, key=lambda sp: (sp.start, sp.rank)))


def _simulate_shared(sched: Schedule, costs, acts, cost, comm: float, durations, dispatch: float,
                     cores: float) -> SimResult:
    """Event-driven processor sharing: between two events (a span's end, a planned start)
    the ``k`` running spans each progress at ``min(1, cores/k)``."""
    p = sched.pp
    finish: dict = {}
    ptr, free = [0] * p, [0.0] * p
    cur: list = [None] * p  # [action, start, work left]
    spans: list = []
    t = 0.0
    while True:
        for r in range(p):
            if cur[r] is None and ptr[r] < len(acts[r]):
                a = acts[r][ptr[r]]
                deps = _deps(a, sched, comm)
                if all(k in finish for k, _ in deps):
                    gap = dispatch if ptr[r] else 0.0
                    start = max([free[r] + gap] + [finish[k] + lat for k, lat in deps])
                    work = durations[a] if durations and a in durations else cost(a.kind, a.stage)
                    cur[r] = [a, start, work]
        live = [r for r in range(p) if cur[r] is not None]
        if not live:
            break
        running = [r for r in live if cur[r][1] <= t]
        nxt = min((cur[r][1] for r in live if cur[r][1] > t), default=math.inf)
        rate = min(1.0, cores / len(running)) if running else 0.0
        if running:
            nxt = min(nxt, t + min(cur[r][2] for r in running) / rate)
        for r in running:
            cur[r][2] -= rate * (nxt - t)
        t = nxt
        for r in running:
            a, start, left = cur[r]
            if left <= 1e-12 * max(1.0, t):
                spans.append(Span(r, a, start, t))
                finish[(a.kind, a.stage, a.microbatch)] = t
                if a.kind == "BW":
                    finish[("B", a.stage, a.microbatch)] = t
                free[r], cur[r] = t, None
                ptr[r] += 1
    return _result(sched, costs, acts, ptr, finish, spans)


def peak_inflight(spans: Sequence[Span], p: int) -> list:
    """Per rank, the most stage-microbatches between ``F`` start and ``BW``/``W`` end."""
    out = []
    for r in range(p):
        ev = []
        for sp in spans:
            if sp.rank != r:
                continue
            if sp.action.kind == "F":
                ev.append((sp.start, 1))
            elif sp.action.kind in ("BW", "W"):
                ev.append((sp.end, -1))
        cur = peak = 0
        for _, d in sorted(ev):  # a release (-1) sorts before an F at the same instant
            cur += d
            peak = max(peak, cur)
        out.append(peak)
    return out


def _explain(sched: Schedule, acts, ptr, stuck, finish) -> str:
    lines = []
    for r in stuck:
        a = acts[r][ptr[r]]
        missing = [k for k, _ in _deps(a, sched, 0.0) if k not in finish]
        for kind, s, i in missing:
            owner = sched.stage_rank(s)
            later = [b for b in acts[r][ptr[r]:] if b.stage == s and b.microbatch == i
                     and (b.kind == kind or (kind == "B" and b.kind == "BW"))]
            dep = Action(s, kind, i)
            if owner == r and later:
                return (f"bad order on rank {r}: {a} is listed before {later[0]}, which it "
                        f"needs")
            lines.append(f"rank {r} waits at {a} for {dep} (rank {owner})")
    return "deadlock: " + "; ".join(lines)
