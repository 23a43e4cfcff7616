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

**All-to-all** (:func:`all_to_all_time`) is no ring: every rank sends ``S/n`` to each peer
at once, so its time is set by the links its bytes cross, not by ring steps. Switched: of a
rank's send buffer ``S``, ``(g−1)/n · S`` stays in the server (NVLink) and ``(n−g)/n · S``
leaves through the rank's **own** network adapter (one per GPU, not ``g`` of them pooled as
a ring gets); the two run in parallel, the slower sets the time. Torus: the bytes that cross
the torus's bisection (:func:`labkit.plan.torus.torus_all_to_all_rate`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from labkit.plan.comm import comm_bytes, normalize_collective
from labkit.plan.hardware import NCCL_BASE_LATENCY, ClusterSpec
from labkit.plan.runtime import LINK_EFFICIENCY
from labkit.plan.torus import torus_all_to_all_rate, torus_rate

__all__ = ["Placement", "place", "collective_time", "all_to_all_time"]


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
        inside_bandwidth: bytes/s per GPU per direction to a member in the same server
            (NVLink; on a torus unused).
        nic_bandwidth: bytes/s per GPU per direction through its own network adapter to
            members in other servers (after oversubscription); ``inf`` when the group stays
            in one server.
        a2a_rate: on a torus, bytes/s at which a rank's all-to-all send buffer drains
            through the bisection (``None`` on a switched cluster).
    """

    size: int
    stride: int
    level: str
    per_server: int
    bandwidth: float
    hop_latency: float
    slowdown: float = 1.0
    ring_steps: Optional[int] = None
    inside_bandwidth: float = math.inf
    nic_bandwidth: float = math.inf
    a2a_rate: Optional[float] = None

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
                         ring_steps=steps,
                         a2a_rate=torus_all_to_all_rate(cluster.torus, node.bandwidth, axes))
    g_server = _members(axes, node.size)
    if g_server == size:
        return Placement(size, stride0, node.name, size, node.bandwidth, node.latency,
                         inside_bandwidth=node.bandwidth)
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
                     slowdown, inside_bandwidth=node.bandwidth, nic_bandwidth=bw)


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
    if c == "all_to_all":
        return all_to_all_time(size_bytes, placement, link_efficiency=link_efficiency)
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


def all_to_all_time(size_bytes: float, placement: Placement,
                    across_bytes: Optional[float] = None,
                    link_efficiency: float = LINK_EFFICIENCY,
                    inside_bytes: Optional[float] = None) -> float:
    """Seconds of one all-to-all in which each rank of ``placement``'s group sends
    ``size_bytes`` (its whole send buffer ``S``, ``S/n`` per destination, its own share
    included) and receives as much.

    Switched cluster, ``g`` members per server: ``(g−1)/n · S`` goes over NVLink at
    ``inside_bandwidth`` and ``(n−g)/n · S`` (or ``across_bytes``, when the runtime sends
    fewer copies across, e.g. DeepSeek-V3's one copy per node) through the rank's own
    adapter at ``nic_bandwidth`` (``inside_bytes`` overrides the NVLink share likewise);
    both at once: ``latency + max(inside, across)``. Torus:
    ``S / a2a_rate`` (the bisection bound, :func:`labkit.plan.torus.torus_all_to_all_rate`).
    Latency: NCCL's base plus one hop (the ``n−1`` transfers are posted together), or the
    torus.s ``⌊ring_steps / 2⌋`` hops (the diameter of the closed rings it spans).

    Raises:
        ValueError: a negative size.
    """
    if size_bytes < 0 or (across_bytes is not None and across_bytes < 0):
        raise ValueError(f"size_bytes and across_bytes must be >= 0, got {size_bytes}, "
                         f"{across_bytes}")
    n, g = placement.size, placement.per_server
    if n == 1 or size_bytes == 0:
        return 0.0
    if placement.a2a_rate is not None:
        hops = max(1, (placement.ring_steps or 0) // 2)
        return (NCCL_BASE_LATENCY + hops * placement.hop_latency
                + size_bytes / (placement.a2a_rate * link_efficiency))
    inside = (g - 1) / n * size_bytes if inside_bytes is None else float(inside_bytes)
    across = (n - g) / n * size_bytes if across_bytes is None else float(across_bytes)
    t_in = inside / (placement.inside_bandwidth * link_efficiency) if inside else 0.0
    t_out = across / (placement.nic_bandwidth * link_efficiency) if across else 0.0
    return NCCL_BASE_LATENCY + placement.hop_latency + max(t_in, t_out)
