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

from dataclasses import dataclass
from typing import Optional

from ..collectives.links import measure_links
from ..plan.emulated import emulated_spec, physical_order, predict_comm
from .step_model import predict_step

__all__ = ["Links", "Variant", "Experiment", "EXPERIMENTS", "measure_cluster_links",
           "run_variant", "warm_up"]


@dataclass(frozen=True)
class Links:
    """Measured busbw (bytes/s) of a pair inside a node and across, and seconds per ring
    step of a tiny message, on one emulated cluster."""

    inside_bw: float
    across_bw: float
    inside_hop_s: float
    across_hop_s: float
    configured: float

    @property
    def ratio(self) -> float:
        return self.inside_bw / self.across_bw

    @property
    def link_error(self) -> float:
        """(measured across − configured) / configured."""
        return self.across_bw / self.configured - 1.0


def measure_cluster_links(cluster, nbytes: int = 4 << 20, iters: int = 3) -> Links:
    """:class:`Links` of ``cluster`` (≥ 2 nodes of ≥ 2 ranks) from its all-reduce busbw at
    ``nbytes`` and at 64 bytes (latency: a 2-rank all-reduce is 2 ring steps)."""
    big = {r["where"]: r for r in measure_links(cluster, ("all_reduce",), nbytes, iters)}
    tiny = {r["where"]: r for r in measure_links(cluster, ("all_reduce",), 64, 5)}
    return Links(big["inside"]["busbw"], big["across"]["busbw"],
                 tiny["inside"]["time_s"] / 2, tiny["across"]["time_s"] / 2,
                 cluster.inter_node)


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
    total, cur = 0.0, None
    for a, b in sorted((e.start, e.end) for e in events):
        if cur is None or a > cur[1]:
            total += (cur[1] - cur[0]) if cur else 0.0
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + ((cur[1] - cur[0]) if cur else 0.0)


def warm_up(cluster, model: str = "small") -> None:
    """One short training job on every rank: a fresh pool's first job imports much of
    torch and labkit (seconds), which would otherwise land in the first variant's steps."""
    from ..config import RunConfig
    from ..jobs import train

    cluster.run(train, RunConfig(model=model, steps=1).replace(dp=cluster.world_size))


def run_variant(cluster, cfg, links: Links, nranks: Optional[int] = None) -> dict:
    """Run ``cfg`` on ``cluster`` (emulated nodes) and measure it beside the planner.

    Returns ``{"step_s", "comm_s", "pred_comm_s", "pred_step_s", "pred_flat_s",
    "pred_bubble", "link_bytes_per_step", "axis_bytes", "losses"}``: the slowest rank's
    median steady step; its seconds inside communication calls per step (spans merged; an
    asynchronous call's span includes the compute it overlapped, a receive the wait for its
    sender); the planner's for the same calls; the planner's step
    (:func:`labkit.measure.step_model.predict_step`: overlap and pipeline as the job runs
    them) and the flat sum (the largest over ranks of compute + predicted communication);
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
    model = predict_step(res.trace, list(ranks), steady, spec, phys, sched,
                         cfg.flushes if sched is not None else 1)
    return {"step_s": slow[0], "comm_s": slow[1], "pred_comm_s": slow[2],
            "pred_step_s": model["step_s"], "pred_flat_s": max(x[3] for x in rows),
            "pred_bubble": model["bubble"],
            "link_bytes_per_step": {k: (after[k] - before[k]) / steps for k in after},
            "axis_bytes": m0.get("comm_bytes_by_axis", {}),
            "losses": res.outputs[0]["losses"]}
