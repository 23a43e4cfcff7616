"""The bubble measured from a run's trace, beside the simulator fed with measured costs.

For every flush (``step``, ``flush``) of a pipeline run, the window is the first compute
span's start to the last one's end over all ranks (seconds on the shared clock); a rank's
busy time is the sum of its ``F``/``B``/``W``/``BW`` spans, its idle time the rest of the
window. Averaged over the measured flushes:

* ``bubble`` = Σ idle / (P · window) — the idle/total definition;
* ``mfu_ceiling`` = 1 − bubble: the fraction of time the ranks compute at all, an upper
  bound on MFU (claim C21's five steps then multiply by the kernels' own efficiency).

The prediction runs :func:`~.simulate.simulate` on the same schedule, built up in rungs so
that each source of idle time is named (:attr:`BubbleReport.ladder`):

1. unit costs — for GPipe and 1F1B the lecture's ``(P−1)/(M+P−1)``;
2. each stage's measured mean ``F``/``B``/``W`` (``BW``) durations — stage imbalance (the
   embedding on the first stage, the head and loss on the last) and ``B ≈ 2F``;
3. plus ``comm`` per cross-rank hop — a separately measured one-way message time. This
   rung is :attr:`BubbleReport.predicted`: every input is measured apart from the idle
   time it predicts;
4. with the executor's overheads measured from the same trace (:func:`overheads`)
   instead: ``hop_s``, the mean time from a producer's span end to the consumer's span
   start when the consumer waited for it, and ``dispatch_s``, the mean gap between two
   spans of one rank when it did not wait. This rung is :attr:`BubbleReport.explained`:
   it says how much of the remaining gap is per-action executor time, which grows with
   the number of actions per rank (interleaved and ZB-V have twice as many). Means of the
   gaps make it an upper-end estimate when ranks share cores: a long gap (a rank waiting
   for a core) that in the run overlapped a wait is counted again on every edge.

Two more numbers check the model:

* ``replayed_bubble`` — the simulator fed every action's *own* measured duration, with no
  communication: the bubble the schedule forces given the real, jittery span lengths. The
  measured bubble can never be below it (the run obeyed the same order and dependencies).
* ``fitted_comm_s`` — the single per-hop delay that, added to every cross-rank edge of the
  replay, reproduces the measured window.
"""
from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from .schedules import Action, Schedule
from .simulate import UNIT, SimResult, simulate

__all__ = ["BubbleReport", "measure_bubble", "overheads", "stage_costs"]

KINDS = ("F", "B", "W", "BW")


def _spans(trace, skip_steps: int) -> list:
    events = trace.events if hasattr(trace, "events") else trace
    return [e for e in events if e.cat == "compute" and e.name in KINDS
            and "stage" in e.args and e.step >= skip_steps]


def stage_costs(trace, schedule: Schedule, skip_steps: int = 1) -> dict:
    """``{kind: [mean seconds per stage]}`` for the kinds the schedule uses."""
    acc: dict = defaultdict(list)
    for e in _spans(trace, skip_steps):
        acc[(e.name, e.args["stage"])].append(e.duration)
    out = {}
    for kind in {k for k, _ in acc}:
        per = [acc.get((kind, s), []) for s in range(schedule.n_stages)]
        out[kind] = [sum(v) / len(v) if v else 0.0 for v in per]
    if "BW" in out:  # the simulator needs B and W; a full backward is their sum
        out.setdefault("B", out["BW"])
        out.setdefault("W", [0.0] * schedule.n_stages)
    return out


def _producer(e, index: dict, schedule: Schedule):
    """The span on another rank whose output ``e`` consumes, or ``None``."""
    s, i, n = e.args["stage"], e.args["microbatch"], schedule.n_stages
    if e.name == "F" and s > 0:
        src = index.get((e.step, e.args.get("flush", 0), "F", s - 1, i))
    elif e.name in ("B", "BW") and s < n - 1:
        src = index.get((e.step, e.args.get("flush", 0), "B", s + 1, i))
    else:
        return None
    return src if src is not None and src.rank != e.rank else None


def overheads(trace, schedule: Schedule, skip_steps: int = 1) -> tuple:
    """``(dispatch_s, hop_s)``: the executor's time between compute spans, in seconds.

    For each span after a rank's first in a flush: when it consumes a tensor from another
    rank whose producing span ended after this rank's previous span, the rank waited, and
    ``start − producer end`` is one hop sample (message time plus the consumer's dispatch);
    otherwise ``start − previous end`` is one dispatch sample. Returns the means (``0.0``
    where there are no samples). Needs one clock for all ranks: true on one machine.
    """
    spans, _ = _measured_spans(trace, skip_steps)
    index = {(e.step, e.args.get("flush", 0), "B" if e.name == "BW" else e.name,
              e.args["stage"], e.args["microbatch"]): e for e in spans}
    lanes: dict = defaultdict(list)
    for e in spans:
        lanes[(e.rank, e.step, e.args.get("flush", 0))].append(e)
    dispatch, hop = [], []
    for lane in lanes.values():
        lane.sort(key=lambda e: e.start)
        for prev, e in zip(lane, lane[1:]):
            src = _producer(e, index, schedule)
            if src is not None and src.end > prev.end:
                hop.append(max(0.0, e.start - src.end))
            else:
                dispatch.append(max(0.0, e.start - prev.end))
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    return mean(dispatch), mean(hop)


@dataclass
class BubbleReport:
    """Measured bubble of one run and the simulator's prediction (seconds, fractions).

    Attributes:
        window: mean flush makespan; busy, idle: per rank, mean per flush.
        bubble: measured idle/total; bubble_vs_ideal: measured Σ idle / Σ busy.
        predicted: the :class:`~.simulate.SimResult` with measured per-stage costs and
            ``comm`` per cross-rank hop (rung 3).
        explained: the same with the trace's hop and dispatch times instead (rung 4).
        dispatch_s, hop_s: the measured overheads (:func:`overheads`), seconds.
        flushes: how many flushes were averaged.
    """

    schedule: Schedule
    window: float
    busy: list
    idle: list
    costs: dict
    predicted: SimResult
    flushes: int
    per_flush: list = field(default_factory=list, repr=False)
    replayed_bubble: float = 0.0
    fitted_comm_s: float = 0.0
    explained: Optional[SimResult] = None
    dispatch_s: float = 0.0
    hop_s: float = 0.0
    comm_s: float = 0.0

    @property
    def bubble(self) -> float:
        return sum(self.idle) / (len(self.idle) * self.window) if self.window else 0.0

    @property
    def bubble_vs_ideal(self) -> float:
        return sum(self.idle) / sum(self.busy) if sum(self.busy) else 0.0

    @property
    def mfu_ceiling(self) -> float:
        return 1.0 - self.bubble

    @property
    def predicted_bubble(self) -> float:
        return self.predicted.bubble

    @property
    def predicted_mfu_ceiling(self) -> float:
        return 1.0 - self.predicted.bubble

    @property
    def gap_pp(self) -> float:
        """Measured − predicted bubble, in percentage points."""
        return 100.0 * (self.bubble - self.predicted.bubble)

    @property
    def explained_gap_pp(self) -> float:
        """Measured − explained (rung 4) bubble, in percentage points."""
        return 100.0 * (self.bubble - self.explained.bubble) if self.explained else 0.0

    @property
    def ladder(self) -> list:
        """``[(rung, bubble)]`` from the unit-cost formula to the measured bubble."""
        s = self.schedule
        unit = simulate(s, UNIT).bubble
        costs = simulate(s, self.costs).bubble
        rungs = [("unit costs", unit), ("+ measured stage costs", costs),
                 (f"+ message time {1e3 * self.comm_s:.2f} ms/hop", self.predicted.bubble)]
        if self.explained is not None:
            rungs.append((f"+ executor: hop {1e3 * self.hop_s:.2f} ms (message included), "
                          f"dispatch {1e3 * self.dispatch_s:.2f} ms", self.explained.bubble))
        return rungs + [("measured", self.bubble)]

    def ladder_text(self) -> str:
        """The :attr:`ladder` on one line: ``"unit costs 42.9% → … → measured 45.1%"``."""
        return " → ".join(f"{name} {b:.1%}" for name, b in self.ladder)

    def rows(self) -> list:
        """Per rank: ``{"rank", "busy_s", "idle_s", "predicted_idle_s"}``."""
        return [{"rank": r, "busy_s": b, "idle_s": i, "predicted_idle_s": p}
                for r, (b, i, p) in enumerate(zip(self.busy, self.idle, self.predicted.idle))]

    def summary(self) -> str:
        """One line: measured and simulated bubble with their gap, the same with the
        executor's measured hop and dispatch times (:attr:`explained`), and the MFU
        ceiling (1 − measured bubble)."""
        s = self.schedule
        line = (f"{s.name:11s} P={s.pp} M={s.microbatches} V={s.virtual}: bubble measured "
                f"{self.bubble:6.1%}, simulated from measured costs "
                f"{self.predicted.bubble:6.1%} "
                f"(gap {self.gap_pp:+.1f} pp)")
        if self.explained is not None:
            line += (f", with the executor's hop {self.hop_s * 1e3:.2f} ms and dispatch "
                     f"{self.dispatch_s * 1e3:.2f} ms {self.explained.bubble:.1%} "
                     f"(gap {self.explained_gap_pp:+.1f} pp)")
        return line + f"; MFU ceiling {self.mfu_ceiling:.1%}"


def measure_bubble(trace, schedule: Schedule, skip_steps: int = 1,
                   comm: float = 0.0) -> BubbleReport:
    """Bubble of the flushes recorded in ``trace`` (a :class:`~labkit.trace.Trace`, or a
    list of events) at steps ``>= skip_steps`` (step 0 pays one-off allocation costs; when
    it is the only step, it is used). ``comm`` (seconds, e.g. the job's measured
    ``p2p_latency_s``) is added to every cross-rank hop of the prediction; ``explained``
    uses the hop and dispatch times measured from the trace instead.

    Raises:
        TypeError: ``schedule`` is not a :class:`~.schedules.Schedule`.
        ValueError: the trace holds no ``F``/``B``/``W``/``BW`` spans, none at steps
            ``>= skip_steps`` (with more than one step), or spans in an order that is not
            ``schedule``'s; ``skip_steps`` not an int >= 0; ``comm`` negative or not finite.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule (cfg.build_schedule()), got "
                        f"{type(schedule).__name__} {schedule!r:.40}")
    if trace is None:
        raise TypeError("trace must be a labkit Trace (result.trace) or a list of events")
    if (isinstance(skip_steps, bool) or not isinstance(skip_steps, numbers.Integral)
            or skip_steps < 0):
        raise ValueError(f"skip_steps must be an int >= 0, got {skip_steps!r}")
    if (isinstance(comm, bool) or not isinstance(comm, numbers.Real)
            or not math.isfinite(comm) or comm < 0):
        raise ValueError(f"comm must be a finite number of seconds >= 0, got {comm!r}")
    skip_steps, comm = int(skip_steps), float(comm)
    spans, used_skip = _measured_spans(trace, skip_steps)
    groups: dict = defaultdict(list)
    for e in spans:
        groups[(e.step, e.args.get("flush", 0))].append(e)
    p = schedule.pp
    # each rank runs its list in order, so its spans sorted by start spell the list
    want = [[(a.kind, a.stage, a.microbatch) for a in acts if a.is_compute]
            for acts in schedule.actions]
    per_flush, replayed, fitted = [], [], []
    for key in sorted(groups):
        ev = groups[key]
        got = [[(e.name, e.args["stage"], e.args["microbatch"])
                for e in sorted(ev, key=lambda e: e.start) if e.rank == r] for r in range(p)]
        if got != want or len(ev) != sum(map(len, want)):
            raise ValueError(
                f"step {key[0]} flush {key[1]} of the trace ran {len(ev)} compute actions "
                f"on ranks {sorted({e.rank for e in ev})} in an order that is not schedule "
                f"{schedule.name} P={schedule.pp} M={schedule.microbatches} "
                f"V={schedule.virtual} ({sum(map(len, want))} actions); pass the schedule "
                "the run used (cfg.build_schedule())")
        t0, t1 = min(e.start for e in ev), max(e.end for e in ev)
        busy = [sum(e.duration for e in ev if e.rank == r) for r in range(p)]
        per_flush.append((t1 - t0, busy))
        durations = {Action(e.args["stage"], e.name, e.args["microbatch"]): e.duration
                     for e in ev}
        replay = simulate(schedule, UNIT, 0.0, durations)
        replayed.append(replay.bubble)
        fitted.append(_fit_comm(schedule, durations, t1 - t0))
    n = len(per_flush)
    window = sum(w for w, _ in per_flush) / n
    busy = [sum(b[r] for _, b in per_flush) / n for r in range(p)]
    costs = stage_costs(spans, schedule, used_skip)
    dispatch, hop = overheads(spans, schedule, used_skip)
    return BubbleReport(schedule, window, busy, [window - b for b in busy], costs,
                        simulate(schedule, costs, comm), n, per_flush, sum(replayed) / n,
                        sum(fitted) / n, simulate(schedule, costs, hop, dispatch=dispatch),
                        dispatch, hop, comm)


def _measured_spans(trace, skip_steps: int) -> tuple:
    """``(spans, skip)``: the compute spans at steps ``>= skip_steps``; a trace of one step
    (step 0 only) is used whole.

    Raises:
        ValueError: no pipeline spans at all, or none left after skipping.
    """
    spans = _spans(trace, skip_steps)
    if spans:
        return spans, skip_steps
    every = _spans(trace, 0)
    if not every:
        raise ValueError("no pipeline compute spans (F/B/W/BW with a 'stage' arg) in the trace")
    steps = sorted({e.step for e in every})
    if steps != [0]:
        raise ValueError(f"skip_steps={skip_steps} leaves no flush: the trace holds steps "
                         f"{steps[0]}–{steps[-1]}")
    return every, 0


def _fit_comm(schedule: Schedule, durations: dict, window: float) -> float:
    """Per-hop delay (seconds) that makes the replay's makespan equal ``window``."""
    lo, hi = 0.0, window
    if simulate(schedule, UNIT, 0.0, durations).makespan >= window:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if simulate(schedule, UNIT, mid, durations).makespan < window:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
