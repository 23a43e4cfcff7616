"""The bubble measured from a run's trace, beside the simulator fed with measured costs.

For every flush (``step``, ``flush``) of a pipeline run, the window is the first compute
span's start to the last one's end over all ranks (seconds on the shared clock); a rank's
busy time is the sum of its ``F``/``B``/``W``/``BW`` spans, its idle time the rest of the
window. Averaged over the measured flushes:

* ``bubble`` = Σ idle / (P · window) — the idle/total definition;
* ``mfu_ceiling`` = 1 − bubble: the fraction of time the ranks compute at all, an upper
  bound on MFU (claim C21's five steps then multiply by the kernels' own efficiency).

The prediction runs :func:`~.simulate.simulate` on the same schedule with each stage's
measured mean ``F``/``B``/``W`` (and ``BW``) durations, so it sees stage imbalance (the
embedding on the first stage, the head and loss on the last), plus an optional per-hop
``comm`` delay (a separately measured message time). Two more numbers explain the gap:

* ``replayed_bubble`` — the simulator fed every action's *own* measured duration, with no
  communication: the bubble the schedule forces given the real, jittery span lengths. The
  measured bubble can never be below it (the run obeyed the same order and dependencies);
  the difference from the prediction is variation of span lengths around their means.
* ``fitted_comm_s`` — the per-hop delay that, added to every cross-rank edge of the replay,
  reproduces the measured window: message latency plus the executor's dispatch time
  between spans (posting sends and receives, bookkeeping).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .schedules import Action, Schedule
from .simulate import UNIT, SimResult, simulate

__all__ = ["BubbleReport", "measure_bubble", "stage_costs"]

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


@dataclass
class BubbleReport:
    """Measured bubble of one run and the simulator's prediction (seconds, fractions).

    Attributes:
        window: mean flush makespan; busy, idle: per rank, mean per flush.
        bubble: measured idle/total; bubble_vs_ideal: measured Σ idle / Σ busy.
        predicted: the :class:`~.simulate.SimResult` with measured per-stage costs.
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

    def rows(self) -> list:
        """Per rank: ``{"rank", "busy_s", "idle_s", "predicted_idle_s"}``."""
        return [{"rank": r, "busy_s": b, "idle_s": i, "predicted_idle_s": p}
                for r, (b, i, p) in enumerate(zip(self.busy, self.idle, self.predicted.idle))]

    def summary(self) -> str:
        s = self.schedule
        return (f"{s.name:11s} P={s.pp} M={s.microbatches} V={s.virtual}: bubble measured "
                f"{self.bubble:6.1%}  simulated {self.predicted.bubble:6.1%}  "
                f"(gap {self.gap_pp:+.1f} pp; replayed {self.replayed_bubble:.1%}, per-hop "
                f"delay {self.fitted_comm_s * 1e3:.2f} ms)  MFU ceiling {self.mfu_ceiling:.1%}")


def measure_bubble(trace, schedule: Schedule, skip_steps: int = 1,
                   comm: float = 0.0) -> BubbleReport:
    """Bubble of the flushes recorded in ``trace`` (a :class:`~labkit.trace.Trace`, or a
    list of events) at steps ``>= skip_steps`` (step 0 pays one-off allocation costs; when
    it is the only step, it is used). ``comm`` (seconds, e.g. the job's measured
    ``p2p_latency_s``) is added to every cross-rank hop of the prediction.

    Raises:
        ValueError: the trace holds no ``F``/``B``/``W``/``BW`` spans.
    """
    spans = _spans(trace, skip_steps) or _spans(trace, 0)
    if not spans:
        raise ValueError("no pipeline compute spans (F/B/W/BW with a 'stage' arg) in the trace")
    used_skip = skip_steps if _spans(trace, skip_steps) else 0
    groups: dict = defaultdict(list)
    for e in spans:
        groups[(e.step, e.args.get("flush", 0))].append(e)
    p = schedule.pp
    per_flush, replayed, fitted = [], [], []
    for key in sorted(groups):
        ev = groups[key]
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
    return BubbleReport(schedule, window, busy, [window - b for b in busy], costs,
                        simulate(schedule, costs, comm), n, per_flush, sum(replayed) / n,
                        sum(fitted) / n)


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
