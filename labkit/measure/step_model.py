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

* **Shared links:** a call that crosses a node boundary gets the share of the node's link
  the run shows it had (:mod:`labkit.measure.link_share`): the planner's worst case
  assumes every rank of the node crossing at once.

All ranks are replayed together: a call starts when every member of its group has reached
it, so a rank early to an all-reduce waits for the late one. The slowest rank's replay is
the prediction.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..plan.emulated import predict_comm
from .link_share import link_efficiency

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


def _plan(events, skip: Callable):
    """One rank's step as marks in measured time (a blocking call; an overlapped call's
    issue and collection), its compute spans, the spans that are not compute, and the
    step's first and last instants."""
    evs = [e for e in events if not skip(e)]
    if not evs:
        return [], [], [], 0.0, 0.0
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
    marks = []
    for e in comm:
        if kind[id(e)] == BLOCKING:
            marks.append((e.start, 0, "block", e))
        else:
            marks += [(e.start, 1, "issue", e), (e.end, 2, "collect", e)]
    marks.sort(key=lambda m: (m[0], m[1]))
    return (marks, [(e.start, e.end) for e in compute], blocked,
            min(e.start for e in evs), max(e.end for e in evs))


def _replay_ranks(by_rank: dict, price: Callable, skip: Callable = lambda e: False) -> dict:
    """Predicted seconds of one step on every rank of ``by_rank`` (``{rank: events}``).

    Each rank advances by its own compute; a call starts when every member of its group
    among ``by_rank`` has reached it (the ``k``-th call of a group on one rank meets the
    ``k``-th on the others: labkit issues a group's calls in one order) and its group's
    earlier calls are done; a blocking call holds the rank until it ends, an overlapped one
    until the rank collects it. Ranks whose calls never meet fall back to replaying alone.
    """
    st = {}
    for r, evs in by_rank.items():
        marks, cspans, blocked, t0, end = _plan(evs, skip)
        st[r] = {"marks": marks, "c": cspans, "b": blocked, "cursor": t0, "end": end,
                 "i": 0, "clock": 0.0, "stream": {}, "calls": {}, "seen": {},
                 "done": {}}
    present = set(by_rank)
    arrivals: dict = {}          # (group, k) -> {rank: time it is ready to start}
    resolved: dict = {}          # (group, k) -> the call's end

    def key_of(e):
        g = (e.cat, tuple(sorted({e.rank, *e.peers})))
        return g, tuple(m for m in g[1] if m in present)

    progress = True
    while progress:
        progress = False
        for r, x in st.items():
            while x["i"] < len(x["marks"]):
                t, _, what, e = x["marks"][x["i"]]
                if t > x["cursor"]:
                    x["clock"] += _covered(x["c"], x["cursor"], t, x["b"])
                    x["cursor"] = t
                g, members = key_of(e)
                if what in ("block", "issue"):
                    if id(e) not in x["seen"]:  # the k-th call of group g on this rank
                        k = x["calls"].get(g, 0)
                        x["calls"][g] = k + 1
                        x["seen"][id(e)] = (g, k)
                        arrivals.setdefault((g, k), {})[r] = max(x["clock"],
                                                                 x["stream"].get(g, 0.0))
                    gk = x["seen"][id(e)]
                    got = arrivals[gk]
                    if gk not in resolved and all(m in got for m in members):
                        resolved[gk] = max(got[m] for m in members) + price(e)
                    if gk not in resolved:
                        if what == "block":
                            break          # wait for the group's other members
                        x["done"][id(e)] = gk
                        x["i"] += 1
                        progress = True
                        continue
                    x["stream"][g] = resolved[gk]
                    if what == "block":
                        x["clock"] = resolved[gk]
                        x["cursor"] = max(x["cursor"], e.end)
                    else:
                        x["done"][id(e)] = gk
                else:  # collect
                    gk = x["done"][id(e)]
                    if gk not in resolved:
                        break
                    x["stream"][gk[0]] = max(x["stream"].get(gk[0], 0.0), resolved[gk])
                    x["clock"] = max(x["clock"], resolved[gk])
                x["i"] += 1
                progress = True
    if any(x["i"] < len(x["marks"]) for x in st.values()) and len(by_rank) > 1:
        return {r: _replay_ranks({r: evs}, price, skip)[r] for r, evs in by_rank.items()}
    return {r: x["clock"] + _covered(x["c"], x["cursor"], x["end"], x["b"])
            for r, x in st.items()}


def _replay(events, price: Callable, skip: Callable = lambda e: False) -> float:
    """Predicted seconds of one rank's step from its ``events`` alone (its groups' other
    members taken as ready): :func:`_replay_ranks` of one rank."""
    rank = next(iter(events)).rank if events else 0
    return _replay_ranks({rank: list(events)}, price, skip)[rank]


def predict_step(trace, ranks: Sequence[int], steps: Sequence[int], spec, phys: dict,
                 schedule=None, flushes: int = 1, shared_links: bool = True) -> dict:
    """The planner's step time of a run from its ``trace`` on ``spec`` (measured links).

    Args:
        trace: the run's :class:`~labkit.trace.Trace`.
        ranks, steps: the ranks, and the steady steps to average over.
        spec, phys: :func:`labkit.plan.emulated.emulated_spec` and
            :func:`~labkit.plan.emulated.physical_order`.
        schedule: the pipeline :class:`~labkit.parallel.pipeline.actions.Schedule` of one
            flush when ``pp > 1`` (``None``: no pipeline); ``flushes`` per step.
        shared_links: give a call that crosses a node boundary the share of the node's
            link the trace shows it had (:func:`labkit.measure.link_share.link_efficiency`);
            ``False``: the planner's worst case, every rank of the node crossing at once.

    Returns:
        ``{"step_s", "per_rank", "pipeline_s", "bubble"}``: the slowest rank's predicted
        seconds per step, every rank's, the simulated pipeline's seconds per step and its
        bubble (idle / total; 0 without a pipeline).
    """
    window = [e for e in trace.events if e.step in steps and e.rank in set(ranks)]
    share = link_efficiency(window, phys, spec.levels[0].size) if shared_links else {}

    def price(e) -> float:
        return predict_comm([e], spec, phys, share.get(id(e), 1.0))

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
    sums = {r: 0.0 for r in ranks}
    for s in steps:
        got = _replay_ranks({r: trace.filter(rank=r, step=s) for r in ranks}, price,
                            in_pipe or (lambda e: False))
        for r in ranks:
            sums[r] += got[r]
    for r in ranks:
        per_rank[r] = pipe_s + sums[r] / len(steps)
    return {"step_s": max(per_rank.values()), "per_rank": per_rank, "pipeline_s": pipe_s,
            "bubble": bubble}
