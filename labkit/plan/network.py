"""Where a parallel group's ranks sit in the hierarchy, and what its collectives cost.

Ranks are numbered so that the innermost axis varies fastest (Llama 3's order
``[TP, CP, PP, DP]``, claim C36): a group of ``n`` ranks of an axis with stride ``σ`` (the
product of the degrees of the axes inside it) has ``g = min(n, D/σ)`` members in each
domain of ``D`` GPUs and spans ``n/g`` such domains.

**Bandwidth of a group** (per GPU, per direction, before :data:`LINK_EFFICIENCY`):

* inside one server: the NVLink rate;
* across servers, as NCCL runs it: one ring per network adapter, so the ``g`` members of a
  server drive ``g`` adapters in parallel and the group gets ``min(NVLink, g · NIC)``
  (nccl-tests' "bus bandwidth", ``doc/PERFORMANCE.md``);
* a ring enters and leaves each domain once, so on a level with oversubscription ``k``
  the traffic leaving a domain of ``D`` GPUs is ``D/g_domain · g_server`` flows against a
  capacity of ``D/k``: the level slows the group by ``max(1, k · g_server / g_domain)``.
  Llama 3's data-parallel groups (one rank per server, 16 per pod) are not slowed by the
  1:7 aggregation layer; a group with one rank in each pod is slowed 7×.

**Time** of a collective of ``S`` bytes: ``latency + comm_bytes(S, n) / (bw · η_link)``
with :func:`labkit.plan.comm.comm_bytes` (ring bytes) and latency ``base + steps · hop``:
``n−1`` ring steps (``2(n−1)`` for all-reduce, or ``2·⌈log₂ n⌉`` on NCCL's double binary
tree when that is fewer; Sanders et al. 2009), hop latency of the network if the group
leaves a server, else of NVLink.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from labkit.plan.comm import comm_bytes, normalize_collective
from labkit.plan.hardware import NCCL_BASE_LATENCY, ClusterSpec
from labkit.plan.runtime import LINK_EFFICIENCY
from labkit.plan.torus import torus_rate

__all__ = ["Placement", "place", "collective_time"]


@dataclass(frozen=True)
class Placement:
    """Where one group of an axis lies.

    Attributes:
        size: ranks in the group ``n``.
        stride: rank distance between neighbours ``σ``.
        level: name of the innermost level that contains the whole group (``"hbm"`` for a
            group of one).
        per_server: members of the group inside one server.
        bandwidth: bytes/s per GPU per direction the group's collectives run at, before
            the link efficiency.
        hop_latency: seconds per ring step.
        slowdown: the oversubscription penalty applied (1 = none).
        ring_steps: ring steps of an all-gather on a torus (``Σ (e_d − 1)`` over the
            axes it spans, :mod:`labkit.plan.torus`); ``None`` on a switched cluster
            (``n − 1``).
    """

    size: int
    stride: int
    level: str
    per_server: int
    bandwidth: float
    hop_latency: float
    slowdown: float = 1.0
    ring_steps: Optional[int] = None

    @property
    def crosses_servers(self) -> bool:
        return self.level not in ("hbm", "nvlink")


def _members_per_domain(size: int, stride: int, domain: int) -> int:
    return max(1, min(size, domain // stride)) if stride < domain else 1


def _members(axes, domain: int) -> int:
    """Members of a group made of ``axes`` ((size, stride) pairs) in one domain."""
    g = 1
    for size, stride in axes:
        g *= _members_per_domain(size, stride, domain)
    return g


@functools.lru_cache(maxsize=8192)
def place(cluster: ClusterSpec, *axes: tuple[int, int]) -> Placement:
    """The :class:`Placement` of a group on ``cluster``.

    Each of ``axes`` is ``(size, stride)``: the group is every combination of ``size``
    ranks ``stride`` apart along each axis (one pair for one axis; two for the ``dp × cp``
    group that reduces gradients).

    Raises:
        ValueError: a size or stride below 1, or a group that needs more GPUs than the
            cluster has.
    """
    if not axes:
        raise ValueError("place() needs at least one (size, stride) pair")
    size, span = 1, 1
    for n, stride in axes:
        if n < 1 or stride < 1:
            raise ValueError(f"group size and stride must be >= 1, got {n}, {stride}")
        size *= n
        span += (n - 1) * stride
    stride0 = min(st for n, st in axes if n > 1) if size > 1 else axes[0][1]
    if size == 1:
        return Placement(1, stride0, "hbm", 1, math.inf, 0.0)
    if span > cluster.n_gpus:
        raise ValueError(f"a group of {size} ranks spans {span} GPUs; {cluster.name} has "
                         f"{cluster.n_gpus}")
    levels = cluster.levels
    node = levels[0]
    if cluster.torus:
        bw, steps, spacing = torus_rate(cluster.torus, node.bandwidth, axes)
        return Placement(size, stride0, node.name, size, bw, node.latency * spacing,
                         ring_steps=steps)
    g_server = _members(axes, node.size)
    if g_server == size:
        return Placement(size, stride0, node.name, size, node.bandwidth, node.latency)
    bw, slowdown, name, hop, inner = math.inf, 1.0, node.name, node.latency, node
    for lv in levels[1:]:
        slow = max(1.0, lv.oversubscription * g_server / _members(axes, inner.size))
        slowdown = max(slowdown, slow)
        bw = min(bw, lv.bandwidth / slow)
        name, hop = lv.name, max(hop, lv.latency)
        if _members(axes, lv.size) == size:
            break
        inner = lv
    return Placement(size, stride0, name, g_server, min(node.bandwidth, g_server * bw), hop,
                     slowdown)


def collective_time(collective: str, size_bytes: float, placement: Placement,
                    link_efficiency: float = LINK_EFFICIENCY) -> float:
    """Seconds one ``collective`` on ``size_bytes`` takes for a group at ``placement``.

    ``size_bytes`` means what it means in :func:`labkit.plan.comm.comm_bytes` (the full
    buffer for all-reduce / reduce-scatter / all-gather, the message for send_recv).
    A group of one costs nothing.

    Raises:
        ValueError: unknown collective or negative size.
    """
    c = normalize_collective(collective)
    n = placement.size
    if n == 1 or size_bytes == 0:
        return 0.0
    if c == "send_recv":
        steps = 1
    elif placement.ring_steps is not None:  # rings along the torus axes
        steps = placement.ring_steps * (2 if c == "all_reduce" else 1)
    elif c == "all_reduce":
        steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    else:
        steps = n - 1
    latency = NCCL_BASE_LATENCY + steps * placement.hop_latency
    moved = comm_bytes(c, size_bytes, n) if c != "send_recv" else float(size_bytes)
    return latency + moved / (placement.bandwidth * link_efficiency)
