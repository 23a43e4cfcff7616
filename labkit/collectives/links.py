"""Bus bandwidth inside an emulated node and across nodes, beside the configured link.

On a cluster of emulated nodes (``lk.Cluster(…, nodes=2)``, :mod:`labkit.nodes`) the same
collective over two ranks runs over the node's loopback when both ranks share a node and
over the shaped node-to-node link when they do not. nccl-tests' bus bandwidth
(``busbw = S / t · factor``, :func:`labkit.collectives.busbw_factor`) is what the slowest
link carried, so the "across" busbw is directly comparable with the configured link rate
(claim C2: the hierarchy, measured with this machine's numbers).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from .. import comm
from . import OPS, busbw_factor
from .bench import _buffers, _call

__all__ = ["LinkConfig", "link_job", "link_pairs", "measure_links", "MiB"]

MiB = 2 ** 20


@dataclass(frozen=True)
class LinkConfig:
    """``ops`` (native) on each of ``groups`` (tuples of global ranks), ``nbytes`` per
    buffer (S as nccl-tests counts it), ``iters`` timed calls after one warm-up."""

    groups: tuple = ((0, 1),)
    ops: tuple = OPS
    nbytes: int = 4 * MiB
    iters: int = 3
    timeout_s: float = 300.0

    def validate(self, world_size: int) -> "LinkConfig":
        for g in self.groups:
            if len(set(g)) != len(g) or len(g) < 2 or not all(0 <= r < world_size for r in g):
                raise ValueError(f"LinkConfig.groups: {g} must be >= 2 distinct ranks of "
                                 f"0 … {world_size - 1}")
        unknown = set(self.ops) - set(OPS)
        if unknown:
            raise ValueError(f"LinkConfig.ops: unknown {sorted(unknown)}; known {OPS}")
        if self.nbytes < 1 or self.iters < 1:
            raise ValueError(f"LinkConfig: nbytes={self.nbytes} and iters={self.iters} must "
                             "be >= 1")
        return self


def link_job(ctx, cfg: LinkConfig) -> list:
    """Job (every rank of the cluster): per group and op, the members' time of each call
    ``{"group", "op", "call", "time_s"}``; the other ranks wait at a barrier."""
    import torch

    ctx.groups.ensure(cfg.groups)  # new_group is collective: every rank, same order
    ctx.tracer.enabled = False
    rows = []
    try:
        for g in cfg.groups:
            group = ctx.groups.get(g)
            for op in cfg.ops:
                member = ctx.rank in g
                if member:
                    bufs = _buffers(op, cfg.nbytes, len(g), torch.float32, ctx.device)
                    fn = _call(op, "native", bufs, group)
                    fn()
                    for i in range(cfg.iters):
                        comm.barrier(group)
                        t0 = time.perf_counter()
                        fn()
                        rows.append({"group": tuple(g), "op": op, "call": i,
                                     "time_s": time.perf_counter() - t0})
                comm.barrier(ctx.group)  # one group's traffic at a time
    finally:
        ctx.tracer.enabled = True
    return rows


def link_pairs(cluster) -> tuple:
    """``(inside, across)``: rank 0 with the next rank of its own node, and rank 0 with the
    first rank of another node, whatever the cluster's placement (block: ``(0, 1), (0,
    per)``; cyclic: ``(0, nodes), (0, 1)``)."""
    home = cluster.node_of(0)
    mate = next(r for r in range(1, cluster.world_size) if cluster.node_of(r) == home)
    away = next(r for r in range(1, cluster.world_size) if cluster.node_of(r) != home)
    return (0, mate), (0, away)


def measure_links(cluster, ops=OPS, nbytes: int = 4 * MiB, iters: int = 3) -> list:
    """busbw of each op over two ranks of one node ("inside") and two ranks of two nodes
    ("across") on ``cluster`` (the pairs of :func:`link_pairs`).

    Returns rows ``{"op", "where", "group", "bytes", "time_s", "busbw", "link"}``: busbw in
    bytes/s from the median over calls of the slower rank's time, ``link`` the configured
    node-to-node rate (bytes/s per direction) for "across", ``None`` inside.

    Raises:
        ValueError: a cluster of one node, or with one rank per node (no "inside" pair).
    """
    per = cluster.world_size // cluster.nodes
    if cluster.nodes < 2 or per < 2:
        raise ValueError(f"measure_links needs >= 2 nodes of >= 2 ranks; the cluster has "
                         f"{cluster.nodes} node(s) of {per} rank(s)")
    inside, across = link_pairs(cluster)
    cfg = LinkConfig((inside, across), tuple(ops), nbytes, iters).validate(cluster.world_size)
    res = cluster.run(link_job, cfg)
    slowest: dict = {}
    for rows in res.outputs:
        for r in rows:
            key = (r["group"], r["op"], r["call"])
            slowest[key] = max(slowest.get(key, 0.0), r["time_s"])
    out = []
    for g, where in ((inside, "inside"), (across, "across")):
        for op in ops:
            t = statistics.median(v for k, v in slowest.items() if k[:2] == (g, op))
            out.append({"op": op, "where": where, "group": g, "bytes": nbytes, "time_s": t,
                        "busbw": nbytes / t * busbw_factor(op, len(g)),
                        "link": cluster.inter_node if where == "across" else None})
    return out
