"""A run's step time as the planner predicts it on measured links, following what the job
overlaps (issue 27).

:func:`labkit.plan.emulated.predict_comm` prices every communication call a run recorded.
Adding those seconds to the run's compute assumes nothing overlaps and nobody waits for
anybody: too slow where labkit's job overlaps (DDP's buckets during backward, FSDP's
prefetched all-gathers), far too fast for a pipeline, whose ranks wait for each other.
:func:`predict_step` replays one rank's step instead, with its measured compute and the
planner's communication:

* **Compute** is the time the trace shows the rank computing and not blocked: compute
  spans, less the blocking communication, the ``"wait"`` spans inside them, and the tail
  of each overlapped call after the last compute that ends inside it (the rank collecting
  the result, e.g. DDP's ``grad_sync`` waiting for its buckets).
* **Blocking calls** (no compute starts while they run: the rank waited) cost their
  predicted seconds on the critical path.
* **Overlapped calls** (compute starts inside their span: issued asynchronously, gloo's
  worker thread moves the bytes meanwhile — DDP's buckets, FSDP's prefetch) run one after
  another on their group's stream (a process group's calls are ordered; different groups,
  e.g. TP's and DP's, proceed side by side) from the moment they are issued; the rank
  waits only where the trace shows it collecting the result (the span's end,
  ``handle.wait()``) and only for what the prediction has not finished by then. A
  blocking call also waits for its group's earlier calls.
* **Pipeline** (``pp > 1``): the forward and backward actions and the point-to-point
  transfers between stages are the schedule's (:func:`labkit.parallel.pipeline.simulate`):
  the measured mean ``F`` and ``B`` of each stage, the predicted transfer of one activation
  on every cross-rank edge — blocking, one per microbatch and direction on the critical
  path — so the warm-up and cool-down bubble comes from the schedule itself. The rest of
  the step (embedding, data-parallel reduction, optimizer) is replayed as above.

The slowest rank's replay is the prediction. Cross-rank waits inside collectives (a rank
early to an all-reduce waits for the late one) are not modelled outside the pipeline.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..plan.emulated import predict_comm

__all__ = ["predict_step", "classify"]

BLOCKING, OVERLAPPED = "blocking", "overlapped"


def _covered(intervals: Sequence[tuple], a: float, b: float,
             minus: Sequence[tuple] = ()) -> float:
    """Length of ``[a, b]`` covered by the union of ``intervals`` and not by ``minus``."""
    if b <= a:
        return 0.0
    pts = sorted({a, b, *(x for iv in (*intervals, *minus) for x in iv if a < x < b)})
    total = 0.0
    for lo, hi in zip(pts, pts[1:]):
        mid = 0.5 * (lo + hi)
        if any(s <= mid < e for s, e in intervals) and not any(s <= mid < e for s, e in minus):
            total += hi - lo
    return total


def classify(comm_events, compute_events) -> dict:
    """``{id(event): "blocking" | "overlapped"}``: overlapped when a compute span starts
    inside the call's span (the rank computed while it ran)."""
    starts = sorted(e.start for e in compute_events)
    out = {}
    for e in comm_events:
        out[id(e)] = OVERLAPPED if any(e.start < s < e.end for s in starts) else BLOCKING
    return out


def _replay(events, price: Callable, skip: Callable = lambda e: False) -> float:
    """Predicted seconds of one rank's step from its ``events`` (one step, sorted or not).

    ``price(event)`` is the planner's seconds for a communication event; events for which
    ``skip(event)`` is true count neither as compute nor as communication."""
    evs = [e for e in events if not skip(e)]
    compute = [e for e in evs if e.cat == "compute"]
    comm = [e for e in evs if e.cat in ("comm", "p2p") and e.op]
    waits = [(e.start, e.end) for e in evs if e.cat == "wait"]
    kind = classify(comm, compute)
    blocked = [(e.start, e.end) for e in comm if kind[id(e)] == BLOCKING] + waits
    # an overlapped call's span after the last compute that ends inside it is the rank
    # collecting it (DDP's grad_sync, a wait inside an enclosing span): not compute
    for e in comm:
        if kind[id(e)] == OVERLAPPED:
            ends = [c.end for c in compute if e.start < c.end < e.end]
            blocked.append((max(ends, default=e.start), e.end))
    cspans = [(e.start, e.end) for e in compute]
    if not evs:
        return 0.0
    t0 = min(e.start for e in evs)
    # boundaries in measured time: a blocking call or a wait (start .. end), an overlapped
    # call's issue (start) and collection (end)
    marks = []
    for e in comm:
        if kind[id(e)] == BLOCKING:
            marks.append((e.start, 0, "block", e))
        else:
            marks += [(e.start, 1, "issue", e), (e.end, 2, "collect", e)]
    marks.sort(key=lambda m: (m[0], m[1]))
    clock, cursor, stream, done = 0.0, t0, {}, {}
    for t, _, what, e in marks:
        if t > cursor:
            clock += _covered(cspans, cursor, t, blocked)
            cursor = t
        g = (e.cat, tuple(sorted({e.rank, *e.peers})))  # the call's group: its stream
        if what == "block":
            clock = stream[g] = max(clock, stream.get(g, 0.0)) + price(e)
            cursor = max(cursor, e.end)
        elif what == "issue":
            done[id(e)] = stream[g] = max(clock, stream.get(g, 0.0)) + price(e)
        else:
            clock = max(clock, done[id(e)])
    end = max(e.end for e in evs)
    return clock + _covered(cspans, cursor, end, blocked)


def predict_step(trace, ranks: Sequence[int], steps: Sequence[int], spec, phys: dict,
                 schedule=None, flushes: int = 1) -> dict:
    """The planner's step time of a run from its ``trace`` on ``spec`` (measured links).

    Args:
        trace: the run's :class:`~labkit.trace.Trace`.
        ranks, steps: the ranks, and the steady steps to average over.
        spec, phys: :func:`labkit.plan.emulated.emulated_spec` and
            :func:`~labkit.plan.emulated.physical_order`.
        schedule: the pipeline :class:`~labkit.parallel.pipeline.actions.Schedule` of one
            flush when ``pp > 1`` (``None``: no pipeline); ``flushes`` per step.

    Returns:
        ``{"step_s", "per_rank", "pipeline_s", "bubble"}``: the slowest rank's predicted
        seconds per step, every rank's, the simulated pipeline's seconds per step and its
        bubble (idle / total; 0 without a pipeline).
    """
    def price(e) -> float:
        return predict_comm([e], spec, phys)

    pipe_s, bubble, per_rank = 0.0, 0.0, {}
    is_action = (lambda e: e.cat == "compute" and e.name in ("F", "B", "BW", "W")
                 and "stage" in (e.args or {}))
    in_pipe: Optional[Callable] = None
    if schedule is not None and schedule.pp > 1:
        from ..parallel.pipeline.simulate import simulate
        acts = [e for e in trace.events if e.step in steps and is_action(e)]
        p2p = [e for e in trace.events if e.step in steps and e.cat == "p2p"
               and e.axis == "pp" and e.op in ("isend", "send")]
        n_st = schedule.n_stages
        costs = {}
        for k in ("F", "B", "W", "BW"):
            per = [[e.end - e.start for e in acts if e.name == k and e.args["stage"] == s]
                   for s in range(n_st)]
            if all(per):
                costs[k] = [sum(x) / len(x) for x in per]
        costs.setdefault("W", [0.0] * n_st)
        link = sum(price(e) for e in p2p) / len(p2p) if p2p else 0.0
        sim = simulate(schedule, costs, comm=link)
        pipe_s, bubble = sim.makespan * flushes, sim.bubble

        def in_pipe(e) -> bool:
            return is_action(e) or (e.cat == "p2p" and e.axis == "pp")
    for r in ranks:
        per = []
        for s in steps:
            evs = trace.filter(rank=r, step=s)
            per.append(_replay(evs, price, in_pipe or (lambda e: False)))
        per_rank[r] = pipe_s + sum(per) / len(per)
    return {"step_s": max(per_rank.values()), "per_rank": per_rank, "pipeline_s": pipe_s,
            "bubble": bubble}
