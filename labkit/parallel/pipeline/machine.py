"""What the machine adds to a pipeline's bubble, measured from a run's trace.

The schedule alone (unit costs) gives the lecture's bubble; the executor's spans carry what
else it needs to predict a real run (see :mod:`.executor`: each span records its wall
interval, ``cpu_s``, the CPU time of its work, and ``exec_cpu_s``, the executor's own CPU
time since the previous span). From them:

* :func:`shared_cores` — the cores the ranks got while computing. When ``k`` ranks compute
  on ``c`` cores each gets ``min(1, c/k)`` of one (processor sharing), so the CPU time
  they consumed is ``∫ min(k(t), c) dt`` over the run's activity profile ``k(t)``; the
  ``c`` that matches the measured CPU time is the machine's share. ``None`` when the spans
  ran at full speed (a core per rank, a GPU per rank) or carry no CPU times.
* :func:`executor_time` — the executor's CPU seconds per compute action (posting messages,
  bookkeeping), the part of its overhead that is its own code.
* :func:`gaps`, :func:`overheads` — wall-clock gaps between spans (hops when the rank
  waited for a message, free gaps otherwise): a diagnostic that mixes the executor, the
  message and the operating system's scheduling.
* :func:`fit_comm` — the per-hop delay that makes a replay of the measured spans last as
  long as the run did.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

from .schedules import Schedule
from .simulate import UNIT, simulate

__all__ = ["shared_cores", "executor_time", "gaps", "overheads", "fit_comm", "flushes"]


def flushes(spans) -> dict:
    """``{(step, flush): [span events]}``."""
    out: dict = defaultdict(list)
    for e in spans:
        out[(e.step, e.args.get("flush", 0))].append(e)
    return out


def _profile(ev) -> dict:
    """``{k: seconds during which exactly k of the spans ran}`` (k >= 1)."""
    edges = sorted([(e.start, 1) for e in ev] + [(e.end, -1) for e in ev])
    out: dict = defaultdict(float)
    k, t = 0, None
    for when, d in edges:
        if k and t is not None:
            out[k] += when - t
        k, t = k + d, when
    return out


def shared_cores(spans, p: int) -> Optional[float]:
    """Cores the ``p`` ranks got while computing (a float in ``(0, p)``), or ``None`` when
    the spans carry no ``cpu_s`` or show no sharing.

    Solves ``Σ_flushes ∫ min(k(t), c) dt = Σ cpu_s`` for ``c`` (the left side increases
    with ``c``; ``k(t)`` is the number of spans running at ``t``)."""
    if not spans or any("cpu_s" not in e.args for e in spans):
        return None
    time_at: dict = defaultdict(float)
    for ev in flushes(spans).values():
        for k, d in _profile(ev).items():
            time_at[k] += d
    cpu = sum(e.args["cpu_s"] for e in spans)

    def used(c: float) -> float:
        return sum(d * min(k, c) for k, d in time_at.items())

    if cpu <= 0 or cpu >= 0.98 * used(p):  # within 2 %: the spans ran at full speed
        return None
    lo, hi = 0.0, float(p)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if used(mid) < cpu else (lo, mid)
    return (lo + hi) / 2


def executor_time(spans) -> float:
    """Mean ``exec_cpu_s`` (seconds) over the spans after a rank's first in a flush; 0.0
    when the spans carry none."""
    vals = []
    for ev in flushes(spans).values():
        first = {}
        for e in sorted(ev, key=lambda e: e.start):
            if e.rank in first and "exec_cpu_s" in e.args:
                vals.append(e.args["exec_cpu_s"])
            first.setdefault(e.rank, e)
    return sum(vals) / len(vals) if vals else 0.0


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


def gaps(spans, schedule: Schedule) -> tuple:
    """``(free, hops)``: wall-clock gaps (seconds) before each span after a rank's first in
    a flush. When the span consumes a tensor from another rank whose producing span ended
    after this rank's previous span, the rank waited, and ``start − producer end`` is a hop
    (message time, the consumer's dispatch and, when ranks share cores, the wait for a
    core); otherwise ``start − previous end`` is a free gap (the executor between two
    spans it did not have to wait for). Needs one clock for all ranks: true on one machine.
    """
    index = {(e.step, e.args.get("flush", 0), "B" if e.name == "BW" else e.name,
              e.args["stage"], e.args["microbatch"]): e for e in spans}
    lanes: dict = defaultdict(list)
    for e in spans:
        lanes[(e.rank, e.step, e.args.get("flush", 0))].append(e)
    free, hop = [], []
    for lane in lanes.values():
        lane.sort(key=lambda e: e.start)
        for prev, e in zip(lane, lane[1:]):
            src = _producer(e, index, schedule)
            if src is not None and src.end > prev.end:
                hop.append(max(0.0, e.start - src.end))
            else:
                free.append(max(0.0, e.start - prev.end))
    return free, hop


def overheads(spans, schedule: Schedule) -> tuple:
    """``(dispatch_s, hop_s)``: the means of :func:`gaps` (``0.0`` where there are none)."""
    free, hop = gaps(spans, schedule)
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    return mean(free), mean(hop)


def fit_comm(schedule: Schedule, durations: dict, window: float) -> float:
    """Per-hop delay (seconds) that makes the replay's makespan equal ``window``; 0.0 when
    the replay without delay already lasts that long."""
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
