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

1. ``unit`` — unit costs: for GPipe and 1F1B the lecture's ``(P−1)/(M+P−1)``;
2. ``stage`` / ``message`` — each stage's measured mean ``F``/``B``/``W`` (``BW``) work,
   then the separately measured one-way message time per hop (``comm``), on a processor
   per rank: stage imbalance (the embedding on the first stage, the head and loss on the
   last), ``B ≈ 2F``, messages (``dedicated``: the schedule on a GPU per rank);
3. ``executor`` — ``predicted``, the schedule *on this machine*: the same plus the
   executor's own CPU time per action (``executor_s``, :mod:`.machine`), a measured,
   named term.

Ranks that share cores (four CPU ranks on the lab's two cores) stretch their spans, and
:func:`~.machine.shared_cores` measures the cores they got. Processor sharing on those
cores (``shared``, kept as a diagnostic) predicts how long a flush lasts, not the bubble:
on the lab machine at low load (1.9 of 2 cores) it put every schedule's bubble 4–15
points under the measured one, because it lets a rank whose input has arrived start at
once at a reduced rate, where the operating system leaves it waiting for a core (idle, in
the trace) until the scheduler wakes it. Two further models of the operating system were
tried against the same traces and dropped, because no one setting of their parameter fit
every schedule: round-robin time slices (GPipe fit at 8 ms, interleaved at 2-4 ms), and
processor sharing entered only once a core is free or after a bounded wait. With a core
per rank (P=2 on the lab's 2 cores) a processor per rank with the measured work is within
2 points for every schedule (``benchmarks/pipeline_bubble.py``); with 4 ranks on 2 cores it
holds for GPipe, 1F1B and ZB-H1, while interleaved and ZB-V, whose warm-up keeps all four
ranks computing at once, measure 4-10 points more. Under heavy outside load no model holds
(read the load beside any figure).

The stage costs are CPU seconds when the spans carry them (the work, which stays the same
when a span stretches because it shares a core) and wall seconds otherwise.

Diagnostics beside the prediction:

* ``replayed_bubble`` — the simulator fed every action's *own* measured wall duration, no
  communication: the bubble the schedule forces given the real, jittery span lengths.
* ``fitted_comm_s`` — the per-hop delay that makes that replay last as long as the run.
* ``explained`` — rung 2 with the wall-clock ``hop_s`` and ``dispatch_s`` gaps read from
  the trace (:func:`~.machine.overheads`) instead of the message time: an upper-end
  estimate when ranks share cores (a wait for a core is counted on every edge).
* :func:`bubble_bands` — the measured bubble as a waterfall of named, modelled bands
  (schedule, stage costs and messages, executor, unexplained rest).
"""
from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from . import machine
from .schedules import Action, Schedule
from .simulate import UNIT, SimResult, simulate

__all__ = ["BubbleReport", "measure_bubble", "overheads", "stage_costs", "bubble_bands"]

KINDS = ("F", "B", "W", "BW")


def _spans(trace, skip_steps: int, instrumented: bool = False) -> list:
    """Pipeline compute spans at steps ``>= skip_steps``; a step run under the memory
    tracker (``instrumented`` in its args: its spans stretch several-fold) only with
    ``instrumented=True``."""
    events = trace.events if hasattr(trace, "events") else trace
    return [e for e in events if e.cat == "compute" and e.name in KINDS
            and "stage" in e.args and e.step >= skip_steps
            and (instrumented or "instrumented" not in e.args)]


def stage_costs(trace, schedule: Schedule, skip_steps: int = 1, cpu: bool = False) -> dict:
    """``{kind: [mean seconds per stage]}`` for the kinds the schedule uses: wall durations,
    or with ``cpu`` the spans' CPU seconds (``cpu_s``)."""
    acc: dict = defaultdict(list)
    for e in _spans(trace, skip_steps):
        acc[(e.name, e.args["stage"])].append(e.args["cpu_s"] if cpu else e.duration)
    out = {}
    for kind in {k for k, _ in acc}:
        per = [acc.get((kind, s), []) for s in range(schedule.n_stages)]
        out[kind] = [sum(v) / len(v) if v else 0.0 for v in per]
    if "BW" in out:  # the simulator needs B and W; a full backward is their sum
        out.setdefault("B", out["BW"])
        out.setdefault("W", [0.0] * schedule.n_stages)
    return out


def overheads(trace, schedule: Schedule, skip_steps: int = 1) -> tuple:
    """``(dispatch_s, hop_s)`` of the measured flushes (:func:`~.machine.overheads`)."""
    spans, _ = _measured_spans(trace, skip_steps)
    return machine.overheads(spans, schedule)


@dataclass
class BubbleReport:
    """Measured bubble of one run and the simulator's prediction (seconds, fractions).

    Attributes:
        window: mean flush makespan; busy, idle: per rank, mean per flush.
        bubble: measured idle/total; bubble_vs_ideal: measured Σ idle / Σ busy.
        costs: per-stage mean wall durations ``{kind: [s]}``; work: the costs the
            simulator is fed (CPU seconds when the trace has them, else ``costs``).
        unit: the unit-cost simulation (the lecture's numbers).
        dedicated: measured work and ``comm`` per hop, a processor per rank (rung 2).
        predicted: the schedule on this machine (rung 3): ``dedicated`` plus
            ``executor_s`` between a rank's actions.
        cores: the cores the ranks got while computing (:func:`~.machine.shared_cores`),
            ``None`` = no sharing seen; executor_s: the executor's CPU seconds per action.
        shared: diagnostic: ``predicted`` on ``cores`` shared cores (processor sharing),
            whose makespan is the flush time those cores allow (module docstring);
            ``None`` without sharing.
        comm_s: the message time per hop fed to rungs 2 and 3.
        explained, dispatch_s, hop_s: the wall-gap diagnostic (module docstring).
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
    work: Optional[dict] = None
    dedicated: Optional[SimResult] = None
    cores: Optional[float] = None
    executor_s: float = 0.0
    shared: Optional[SimResult] = None

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
    def unit(self) -> SimResult:
        return simulate(self.schedule, UNIT)

    @property
    def gap_pp(self) -> float:
        """Measured − predicted bubble, in percentage points."""
        return 100.0 * (self.bubble - self.predicted.bubble)

    @property
    def explained_gap_pp(self) -> float:
        """Measured − explained (wall-gap diagnostic) bubble, in percentage points."""
        return 100.0 * (self.bubble - self.explained.bubble) if self.explained else 0.0

    def rungs(self) -> list:
        """``[(key, label, bubble)]``: keys ``unit``, ``stage``, ``message``, then
        ``executor`` where measured, then ``measured``; each rung adds one named, measured
        term to the one before."""
        s, work = self.schedule, self.work or self.costs
        out = [("unit", "unit costs", self.unit.bubble),
               ("stage", "+ measured stage costs", simulate(s, work).bubble),
               ("message", f"+ message time {1e3 * self.comm_s:.2f} ms/hop",
                (self.dedicated or self.predicted).bubble)]
        if self.executor_s:
            out.append(("executor", f"+ executor {1e3 * self.executor_s:.2f} ms/action",
                        self.predicted.bubble))
        return out + [("measured", "measured", self.bubble)]

    @property
    def ladder(self) -> list:
        """``[(rung, bubble)]`` from the unit-cost formula to the measured bubble."""
        return [(label, b) for _, label, b in self.rungs()]

    def ladder_text(self) -> str:
        """The :attr:`ladder` on one line: ``"unit costs 42.9% → … → measured 45.1%"``."""
        return " → ".join(f"{name} {b:.1%}" for name, b in self.ladder)

    def rows(self) -> list:
        """Per rank: ``{"rank", "busy_s", "idle_s", "predicted_idle_s"}``."""
        return [{"rank": r, "busy_s": b, "idle_s": i, "predicted_idle_s": p}
                for r, (b, i, p) in enumerate(zip(self.busy, self.idle, self.predicted.idle))]

    def summary(self) -> str:
        """Three lines (each under 100 characters, to fit a notebook cell): the measured
        bubble beside the simulation on this machine and their gap; the simulation's measured
        terms and the unit-cost bubble; the MFU ceiling and, where the ranks shared cores, the
        flush time processor sharing predicts beside the measured one."""
        s = self.schedule
        terms = ([f"executor {1e3 * self.executor_s:.2f} ms/action"] if self.executor_s
                 else []) + [f"message {1e3 * self.comm_s:.2f} ms/hop"]
        pad = " " * 12
        out = (f"{s.name:11s} P={s.pp} M={s.microbatches} V={s.virtual}: bubble measured "
               f"{self.bubble:6.1%}, simulated on this machine {self.predicted.bubble:6.1%} "
               f"(gap {self.gap_pp:+.1f} pp)\n"
               f"{pad}simulated with measured stage costs, {', '.join(terms)}; "
               f"unit costs {self.unit.bubble:.1%}\n"
               f"{pad}MFU ceiling {self.mfu_ceiling:.1%}")
        if self.shared is not None:
            out += (f"; ranks got {self.cores:.2f} cores: flush {1e3 * self.window:.1f} ms, "
                    f"{1e3 * self.shared.makespan:.1f} ms with processor sharing")
        return out

def bubble_bands(report: BubbleReport) -> list:
    """The measured bubble as a waterfall of named bands, for a figure.

    Returns ``[{"name", "delta", "bubble"}]`` (fractions of the window), in order:
    ``"schedule"`` (the unit-cost bubble), ``"stage costs + messages"`` (the schedule on a
    processor per rank), ``"executor"`` (where measured), and ``"unexplained"`` (measured −
    predicted). ``delta`` is what the band adds, ``bubble`` the running total: the last
    equals the measured bubble. A delta can be negative (measured stage costs can be more
    even than unit costs assume; a run can idle less than predicted).
    """
    names = {"unit": "schedule", "message": "stage costs + messages", "executor": "executor",
             "measured": "unexplained"}
    out, prev = [], 0.0
    for key, _, b in report.rungs():
        if key in names:
            out.append({"name": names[key], "delta": b - prev, "bubble": b})
            prev = b
    return out


def measure_bubble(trace, schedule: Schedule, skip_steps: int = 1,
                   comm: float = 0.0) -> BubbleReport:
    """Bubble of the flushes recorded in ``trace`` (a :class:`~labkit.trace.Trace`, or a
    list of events) at steps ``>= skip_steps`` (step 0 pays one-off allocation costs; when
    it is the only step, it is used; a step run under the memory tracker is left out
    unless nothing else ran). ``comm`` (seconds, e.g. the job's measured
    ``p2p_latency_s``) is added to every cross-rank hop of the prediction.

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
    groups = machine.flushes(spans)
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
        replayed.append(simulate(schedule, UNIT, 0.0, durations).bubble)
        fitted.append(machine.fit_comm(schedule, durations, t1 - t0))
    n = len(per_flush)
    window = sum(w for w, _ in per_flush) / n
    busy = [sum(b[r] for _, b in per_flush) / n for r in range(p)]
    costs = stage_costs(spans, schedule, used_skip)
    has_cpu = all("cpu_s" in e.args for e in spans)
    work = stage_costs(spans, schedule, used_skip, cpu=True) if has_cpu else costs
    cores = machine.shared_cores(spans, p)
    executor_s = machine.executor_time(spans)
    dedicated = simulate(schedule, work, comm)
    predicted = simulate(schedule, work, comm, dispatch=executor_s) if executor_s else dedicated
    shared = (simulate(schedule, work, comm, dispatch=executor_s, cores=cores)
              if cores is not None else None)
    dispatch, hop = machine.overheads(spans, schedule)
    return BubbleReport(schedule, window, busy, [window - b for b in busy], costs,
                        predicted, n, per_flush, sum(replayed) / n, sum(fitted) / n,
                        simulate(schedule, costs, hop, dispatch=dispatch), dispatch, hop, comm,
                        work, dedicated, cores, executor_s, shared)


def _measured_spans(trace, skip_steps: int) -> tuple:
    """``(spans, skip)``: the compute spans at steps ``>= skip_steps``; a trace of one step
    (step 0 only) is used whole.

    Raises:
        ValueError: no pipeline spans at all, or none left after skipping.
    """
    spans = _spans(trace, skip_steps)
    if spans:
        return spans, skip_steps
    every = _spans(trace, 0) or _spans(trace, 0, instrumented=True)
    if not every:
        raise ValueError("no pipeline compute spans (F/B/W/BW with a 'stage' arg) in the trace")
    steps = sorted({e.step for e in every})
    if steps != [0]:
        raise ValueError(f"skip_steps={skip_steps} leaves no flush: the trace holds steps "
                         f"{steps[0]}–{steps[-1]}")
    return every, 0
