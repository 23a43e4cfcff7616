"""The lectures' layout experiments on emulated nodes, measured beside the planner.

The rule "tensor parallelism inside a server, pipeline and data parallelism across" (claims
C16, C27, C33, C34) becomes an experiment on :mod:`labkit.nodes`: the same training job in
two layouts that differ only in which traffic crosses the node boundary. Each variant
reports its step time, the bytes each node's link carried (the kernel's tc counters) and
labkit's per-axis bytes, and the planner's prediction: every communication call the run
recorded, priced by :mod:`labkit.plan.network` on a hierarchy built from this cluster's
measured links (:mod:`labkit.plan.emulated`). The predicted step follows what the job
does (:mod:`labkit.measure.step_model`): the run's own compute, blocking calls on the
critical path, asynchronous ones (DDP's buckets, FSDP's prefetched gathers) hidden where
the compute allows, and a pipeline's stages, bubble and per-microbatch transfers from its
schedule. ``pred_flat_s`` keeps the earlier sum — compute + every call's predicted
seconds, nothing overlapped, no bubble — beside it.

"block" placement keeps consecutive ranks in a node (the mesh's order, tp innermost);
"cyclic" deals them round robin — as if the mesh's order were reversed.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from ..collectives.links import measure_links
from ..plan.emulated import emulated_spec, physical_order, predict_comm
from .link_share import covered
from .step_model import predict_step

__all__ = ["Links", "Variant", "Experiment", "EXPERIMENTS", "SWEEP", "fit_alpha_beta",
           "measure_cluster_links", "run_variant", "warm_up"]


@dataclass(frozen=True)
class Links:
    """One emulated cluster's links, fitted from a sweep of 2-rank all-reduces inside a
    node and across (:func:`measure_cluster_links`).

    ``inside_bw``/``across_bw``: busbw in bytes/s and ``inside_hop_s``/``across_hop_s``:
    seconds per ring step, the line ``t(S) = base + 2·hop + S / busbw`` that
    :func:`labkit.plan.network.collective_time` prices a two-rank all-reduce with, fitted
    to the sweep (:func:`fit_alpha_beta`); ``configured``: the node link's rate, bytes/s per
    direction; ``points``: the sweep, ``((where, bytes, seconds), …)``, each size's median
    over calls of the slower rank's time.
    """

    inside_bw: float
    across_bw: float
    inside_hop_s: float
    across_hop_s: float
    configured: float
    points: tuple = ()

    @property
    def ratio(self) -> float:
        return self.inside_bw / self.across_bw

    @property
    def link_error(self) -> float:
        """(measured across − configured) / configured."""
        return self.across_bw / self.configured - 1.0


#: message sizes (bytes) of the links' sweep: the range of a small job's calls
SWEEP = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20)


def fit_alpha_beta(points, base: float = 0.0, big: float = 1 << 20) -> tuple:
    """``(hop_s, busbw)`` of the line ``t = base + 2·hop + S / busbw`` through ``points``
    (``(S bytes, t seconds)`` of two-rank all-reduces, busbw factor 1), in two robust steps
    (Hockney's α–β model, each term from the sizes that show it):

    1. **busbw** from the slope of a least-squares line through the calls of at least
       ``big`` bytes (the two largest sizes when fewer reach it), where the bytes dominate;
    2. **the hop** from the median over every point of what its time leaves once its bytes
       are paid (``t − S / busbw``): one slow tiny call, or one mid-size call that crossed
       on the link's bucket, moves a median little — a line through one tiny and one big
       call let a single noisy tiny call set the latency of every call. Clamped at 0.

    Raises:
        ValueError: fewer than two distinct sizes, or a time that is not positive.
    """
    pts = sorted((float(x), float(t)) for x, t in points)
    sizes = sorted({x for x, _ in pts})
    if len(sizes) < 2 or any(t <= 0 for _, t in pts):
        raise ValueError(f"fit_alpha_beta needs >= 2 distinct sizes and positive times; "
                         f"got {pts}")
    cut = min(big, sizes[-2])
    tail = [(x, t) for x, t in pts if x >= cut]
    mx = sum(x for x, _ in tail) / len(tail)
    mt = sum(t for _, t in tail) / len(tail)
    b = (sum((x - mx) * (t - mt) for x, t in tail) / sum((x - mx) ** 2 for x, _ in tail))
    if b <= 0:  # the big calls no slower than smaller ones: the largest one's average rate
        b = pts[-1][1] / pts[-1][0]
    a = statistics.median(t - x * b for x, t in pts)
    return max(0.0, (a - base) / 2), 1.0 / b


def measure_cluster_links(cluster, sizes=SWEEP, iters: int = 15) -> Links:
    """:class:`Links` of ``cluster`` (≥ 2 nodes of ≥ 2 ranks, any placement): a two-rank
    all-reduce inside a node and across (:func:`~labkit.collectives.links.link_pairs`) at
    each of ``sizes`` bytes, ``iters`` calls each, and each pair's line fitted to the sweep
    (:func:`fit_alpha_beta`).

    Raises:
        ValueError: a cluster of one node or one rank per node (from ``measure_links``).
    """
    from ..plan.hardware import NCCL_BASE_LATENCY

    points = []
    for nbytes in sizes:
        for r in measure_links(cluster, ("all_reduce",), nbytes, iters):
            points.append((r["where"], nbytes, r["time_s"]))
    fit = {w: fit_alpha_beta([(x, t) for ww, x, t in points if ww == w], NCCL_BASE_LATENCY)
           for w in ("inside", "across")}
    return Links(fit["inside"][1], fit["across"][1], fit["inside"][0], fit["across"][0],
                 cluster.inter_node, tuple(points))


@dataclass(frozen=True)
class Variant:
    """One layout: a label, :class:`~labkit.config.RunConfig` changes and the placement."""

    label: str
    changes: tuple  # ((field, value), ...) for RunConfig.replace
    placement: str = "block"


@dataclass(frozen=True)
class Experiment:
    name: str
    claim: str
    lecture: str
    a: Variant
    b: Variant


EXPERIMENTS = (
    Experiment("TP=2 inside a node vs across", "C27",
               "TP throughput drops 10-12 % inside a server, 42-65 % across servers",
               Variant("tp inside", (("tp", 2), ("dp", 1))),
               Variant("tp across", (("tp", 2), ("dp", 1)), "cyclic")),
    Experiment("mesh order: TP innermost vs outermost (dp2 x tp2)", "C34",
               "TP innermost (inside the server), DP outer",
               Variant("tp innermost", (("tp", 2), ("dp", 2))),
               Variant("tp outermost", (("tp", 2), ("dp", 2)), "cyclic")),
    Experiment("FSDP over all 4 vs HSDP (shards inside a node)", "C16",
               "HSDP keeps the frequent gathers inside the group; only an all-reduce crosses",
               Variant("fsdp across all", (("dp", 4), ("zero_stage", 3))),
               Variant("hsdp 2x2", (("dp", 4), ("zero_stage", 3), ("hsdp_replicas", 2)))),
    Experiment("PP across the boundary vs DP across (pp2 x dp2)", "C33",
               "PP sends activations point to point: fewer bytes across than DP's gradients",
               Variant("pp across", (("pp", 2), ("dp", 2))),
               Variant("dp across", (("pp", 2), ("dp", 2)), "cyclic")),
)


def _union(events) -> float:
    """Seconds covered by the events' spans, overlaps counted once."""
    return covered([(e.start, e.end) for e in events])


def warm_up(cluster, model: str = "small") -> None:
    """One short training job on every rank: a fresh pool's first job imports much of
    torch and labkit (seconds), which would otherwise land in the first variant's steps."""
    from ..config import RunConfig
    from ..jobs import train

    cluster.run(train, RunConfig(model=model, steps=1).replace(dp=cluster.world_size))


def run_variant(cluster, cfg, links: Links, nranks: Optional[int] = None) -> dict:
    """Run ``cfg`` on ``cluster`` (emulated nodes) and measure it beside the planner.

    Returns ``{"step_s", "comm_s", "pred_comm_s", "pred_step_s", "pred_worst_s", "pred_flat_s",
    "pred_bubble", "link_bytes_per_step", "axis_bytes", "losses"}``: the slowest rank's
    median steady step; its seconds inside communication calls per step (spans merged; an
    asynchronous call's span includes the compute it overlapped, a receive the wait for its
    sender); the planner's for the same calls; the planner's step
    (:func:`labkit.measure.step_model.predict_step`: overlap and pipeline as the job runs
    them, each crossing call with the share of its node's link the run shows; ``_worst_``:
    every rank of a node crossing at once) and the flat sum (the largest over ranks of compute + predicted communication);
    the simulated pipeline bubble; bytes each node's link carried per step (tc counters,
    headers included); rank 0's bytes sent per mesh axis per step (labkit.comm).
    """
    from ..jobs import train

    net = cluster.network
    before = net.link_bytes() if net is not None else {}
    res = cluster.run(train, cfg, nranks=nranks)
    after = net.link_bytes() if net is not None else {}
    n = len(res.outputs)
    steps = cfg.steps
    ranks = range(n)
    active = [cluster.node_of(r) for r in ranks]
    per = max(active.count(k) for k in set(active))
    spec = emulated_spec(len(set(active)), per, links.inside_bw, links.across_bw,
                         links.inside_hop_s, links.across_hop_s)
    phys = physical_order(ranks, cluster.node_of)
    flagged = res.trace.instrumented_steps()  # the memory-tracked step is slower
    steady = [s for s in range(1, steps) if s not in flagged] or [steps - 1]
    rows = []
    for r, out in enumerate(res.outputs):
        m = out["metrics"]
        ev = [e for e in res.trace.filter(rank=r) if e.step in steady
              and e.cat in ("comm", "p2p")]
        mine = [e for e in res.trace.filter(rank=r) if e.step in steady]
        comm_s = _union([e for e in mine if e.cat in ("comm", "p2p")]) / len(steady)
        # a layer's region encloses its TP collectives: compute is the busy time of
        # compute and communication together, less the communication's
        busy = _union([e for e in mine if e.cat in ("compute", "comm", "p2p")])
        compute_s = busy / len(steady) - comm_s
        pred = predict_comm(ev, spec, phys) / len(steady)
        step = m["step_time_s"]  # the train loop's median of its steady steps
        rows.append((step, comm_s, pred, compute_s + pred))
    slow = max(rows, key=lambda x: x[0])
    m0 = res.outputs[0]["metrics"]
    sched = cfg.build_schedule() if cfg.parallel.pp > 1 else None
    flushes = cfg.flushes if sched is not None else 1
    model = predict_step(res.trace, list(ranks), steady, spec, phys, sched, flushes)
    worst = predict_step(res.trace, list(ranks), steady, spec, phys, sched, flushes,
                         shared_links=False)
    return {"step_s": slow[0], "comm_s": slow[1], "pred_comm_s": slow[2],
            "pred_step_s": model["step_s"], "pred_worst_s": worst["step_s"],
            "pred_flat_s": max(x[3] for x in rows),
            "pred_bubble": model["bubble"],
            "link_bytes_per_step": {k: (after[k] - before[k]) / steps for k in after},
            "axis_bytes": m0.get("comm_bytes_by_axis", {}),
            "losses": res.outputs[0]["losses"]}
