"""ZeRO-3 / FSDP (and HSDP) from labkit's traced collectives.

Every rank keeps only its shard (``Ψ/K`` elements) of each unit's flat parameter, gradient
and Adam state: 16Ψ/K bytes of model state (Rajbhandari et al. 2020, §5.3, P_os+g+p).
The lecture's six steps per unit — all-gather before forward, free after; all-gather again
before backward; reduce-scatter the gradient and free it; each rank updates its shard —
are FSDP's (Zhao et al. 2023, "PyTorch FSDP", §3.2–3.3, §4.1):

* **Forward.** A forward pre-hook on the unit's module waits for (or issues) the unit's
  all-gather into ``flat`` and installs the parameter views (see :mod:`labkit.parallel.flat`);
  with ``prefetch`` it then issues the *next* unit's all-gather asynchronously, so the
  transfer runs (gloo's worker thread) while this unit computes. A forward hook frees the
  unit (``flat``'s storage is resized to 0 — the saved views keep pointing at that same
  storage) and registers a tensor hook on the unit's output.
* **Turn.** The root unit (embedding, final norm, head: it finishes forward last) stays
  gathered into backward when ``keep_last`` (FSDP2 does the same for its root), which
  skips one all-gather of the root.
* **Backward.** The output's tensor hook fires when the gradient reaching the unit is
  ready, i.e. just before its backward: the hook re-gathers ``flat`` *into the same
  storage*, so the activations autograd saved (views of ``flat``) are valid again —
  writes go through ``flat.data``, which has its own version counter, so autograd's saved-
  tensor check is not tripped. With ``prefetch`` it issues the all-gather of the unit whose
  backward comes next (reverse order of the forward hooks of this step). When the unit's
  backward is complete, autograd accumulates ``flat.grad`` once and ``flat``'s
  post-accumulate-grad hook reduce-scatters it (mean, async) into the rank's gradient shard
  and frees the parameters; ``flat.grad`` is dropped when the reduce-scatter completes.
* **HSDP.** With a replicate group (``M`` replicas of ``K`` shards) the gradient shards are
  all-reduced across replicas after the reduce-scatters: FSDP inside, DP across.

Why hooks on outputs rather than ``register_full_backward_pre_hook``: full backward hooks
wrap inputs and outputs in an extra autograd node per call and require tensor inputs; a
tensor hook is the smallest thing that runs right before the unit's backward, as in FSDP1's
``_register_pre_backward_hooks``.

Memory: parameters, gradients and Adam state are ``K``-way shards; the *working set* is
the gathered units (root + the current block + one prefetched block) and the in-flight
full gradients of at most ``max_inflight`` units; both peaks are recorded
(``max_gathered_bytes``, ``max_inflight_grad_bytes``). Each wait on an all-gather is
recorded as a ``"wait"`` trace event (issuing one too: the compute thread is not computing
then), so the fraction of all-gather time hidden under compute is
``1 − blocked / all-gather span``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..trace import COMPUTE, Event, current_tracer
from .flat import FlatUnit, ShardedDataParallel

__all__ = ["FullyShardedDataParallel", "hsdp_groups"]


class FullyShardedDataParallel(ShardedDataParallel):
    """ZeRO stage 3 / FSDP over ``shard_group``; HSDP with a ``replicate_group``.

    Args:
        module: the model (units: ``module.layers`` unless ``units`` is given).
        shard_group, replicate_group: see :func:`hsdp_groups`.
        prefetch: issue the next unit's all-gather before computing the current one.
        keep_last: keep the root unit gathered across the forward→backward turn.
        mixed_precision: bf16 parameters, gradients and traffic; fp32 master shards.

    Per step: ``forward``/``backward``, ``finish_gradient_sync()``, ``optimizer.step()``,
    ``after_step()``, ``zero_grad()`` (see :class:`ShardedDataParallel`).
    """

    def __init__(self, module: nn.Module, shard_group=None, replicate_group=None, *,
                 prefetch: bool = True, keep_last: bool = True,
                 mixed_precision: bool = False, units: Optional[Sequence[nn.Module]] = None,
                 max_inflight: int = 1, axis: str = "dp"):
        super().__init__(module, shard_group, replicate_group, stage=3,
                         mixed_precision=mixed_precision, units=units,
                         max_inflight=max_inflight, axis=axis)
        self.prefetch, self.keep_last = prefetch, keep_last
        self.gathered_bytes = self.max_gathered_bytes = 0
        self._fw_order = list(self.units)   # registration order until a forward ran
        self._fw_now: list = []
        self._post_order: list = []
        self._bw_order: Optional[list] = None
        self._elem = torch.tensor([], dtype=self.param_dtype).element_size()
        for u in self.units:
            u.module.register_forward_pre_hook(self._pre_forward_hook(u))
            u.module.register_forward_hook(self._post_forward_hook(u))

    @property
    def root(self) -> Optional[FlatUnit]:
        return self.units[0] if len(self.units) and self.units[0].name == "root" else None

    def gathered_buffers(self) -> list:
        """The flat buffers that hold gathered parameters (pass to ``measure_memory``'s
        ``track`` so their bytes count as "other", the working set)."""
        return [u.flat for u in self.units]

    def forward(self, *args, **kwargs):
        self._tracer = current_tracer()
        self._drain()
        self._fw_now, self._post_order, self._bw_order = [], [], None
        out = self.module(*args, **kwargs)
        if self._fw_now:
            self._fw_order = self._fw_now
        return out

    def finish_gradient_sync(self) -> None:
        super().finish_gradient_sync()
        for u in self.units:  # anything left gathered (e.g. a prefetch never used)
            self._reshard(u)
            u.bw_started = False

    def after_step(self) -> None:
        """After ``optimizer.step()``: mixed precision copies the fp32 master shards into
        the bf16 shards that the next all-gathers send (fp32: the shard is the master)."""
        if self.mixed_precision:
            with torch.no_grad():
                for u in self.units:
                    u.shard.copy_(u.master)

    # -- the six steps -------------------------------------------------------------------
    def _pre_forward_hook(self, u: FlatUnit):
        def hook(module, args):
            self._fw_now.append(u)
            self._gather(u, "forward")
            self._wait(u, "forward")
            u.install_views()
            if self.prefetch:
                nxt = _after(self._fw_order, u)
                if nxt is not None:
                    self._gather(nxt, "forward")
            u.t_compute = _now()
        return hook

    def _post_forward_hook(self, u: FlatUnit):
        def hook(module, args, output):
            _span(f"{u.name}.forward", u.t_compute, u.name)
            self._post_order.append(u)
            grad = torch.is_grad_enabled()
            if not (grad and self.keep_last and u is self.root):
                self._reshard(u)
            if grad:
                u.bw_started = False
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward_hook(u))
        return hook

    def _pre_backward_hook(self, u: FlatUnit):
        def hook(grad):
            return self._traced(self._pre_backward, u)
        return hook

    def _pre_backward(self, u: FlatUnit) -> None:
        if u.bw_started:
            return
        u.bw_started = True
        if self._bw_order is None:
            self._bw_order = list(reversed(self._post_order))
        self._gather(u, "backward")
        self._wait(u, "backward")
        if self.prefetch:
            nxt = _after(self._bw_order, u)
            if nxt is not None:
                self._gather(nxt, "backward")
        u.t_compute = _now()

    def _post_backward(self, u: FlatUnit) -> None:
        _span(f"{u.name}.backward", u.t_compute, u.name)
        self._reduce_scatter(u)
        self._reshard(u)
        u.bw_started = False

    # -- gather / free ---------------------------------------------------------------------
    def _gather(self, u: FlatUnit, phase: str) -> None:
        if u.gathered or u.handle is not None:
            return
        t0 = _now()
        u.flat.untyped_storage().resize_(u.padded * self._elem)
        u.handle = comm.all_gather(u.flat.data, u.shard.detach(), group=self.shard_group,
                                   axis=self.axis, async_op=True, unit=u.name, phase=phase,
                                   mesh_dim="shard")
        _blocked("issue", t0, u.name, phase)
        self.gathered_bytes += u.padded * self._elem
        self.max_gathered_bytes = max(self.max_gathered_bytes, self.gathered_bytes)

    def _wait(self, u: FlatUnit, phase: str) -> None:
        if u.handle is None:
            return
        t0 = _now()
        u.handle.wait()
        u.handle, u.gathered = None, True
        _blocked("wait", t0, u.name, phase)

    def _reshard(self, u: FlatUnit) -> None:
        if u.handle is not None:
            self._wait(u, "reshard")
        if u.gathered:
            u.flat.untyped_storage().resize_(0)
            u.gathered = False
            self.gathered_bytes -= u.padded * self._elem


def hsdp_groups(group, replicas: int, cache: Optional[dict] = None):
    """``(shard_group, replicate_group)`` of an ``M = replicas`` × ``K`` mesh over ``group``.

    Group ranks ``[g·K, (g+1)·K)`` form shard group ``g``; ranks with equal index inside
    their shard group form a replicate group. ``replicas == 1`` gives ``(group, None)``.
    Groups are cached in ``cache`` keyed by their rank tuples.

    When ``group`` spans the whole world, every rank creates every group in the same order
    (shard groups, then replicate groups), as ``new_group`` requires. On a job that uses
    only part of a cluster the idle ranks cannot join, so the groups are created with
    ``use_local_synchronization``; torch names those by the ranks *and* the number of
    groups each member already belongs to (``_hash_ranks_to_str``), so members must agree
    on that count — checked first, since a mismatch would hang.

    Raises:
        ValueError: ``replicas`` does not divide the group size.
        RuntimeError: a partial-cluster job whose ranks belong to different numbers of
            process groups (run HSDP on a cluster whose world size is the job's ranks).
    """
    ranks = comm.group_ranks(group)
    n = len(ranks)
    if replicas < 1 or n % replicas:
        raise ValueError(f"hsdp_replicas={replicas} does not divide the {n} ranks of the group")
    if replicas == 1:
        return group, None
    k = n // replicas
    g, i = divmod(ranks.index(dist.get_rank()), k)
    shards = [tuple(ranks[j * k:(j + 1) * k]) for j in range(replicas)]
    repls = [tuple(ranks[j::k]) for j in range(k)]
    cache = {} if cache is None else cache
    key = ("hsdp-groups", ranks, replicas)
    if key not in cache:
        if n == dist.get_world_size():
            made = {rs: dist.new_group(list(rs)) for rs in shards + repls}
        else:
            from torch.distributed import distributed_c10d as c10d
            mine = torch.tensor([float(len(c10d._world.pg_names))])
            seen = torch.empty(n)
            comm.all_gather(seen, mine, group=group)
            if len(set(seen.tolist())) > 1:
                raise RuntimeError(
                    f"HSDP on {n} of the cluster's {dist.get_world_size()} ranks: the job's "
                    f"ranks belong to different numbers of process groups "
                    f"({seen.int().tolist()}), so torch would give their local sub-groups "
                    f"different names and hang. Use a cluster with world_size={n}.")
            made = {rs: dist.new_group(list(rs), use_local_synchronization=True)
                    for rs in (shards[g], repls[i])}
        cache[key] = made
    made = cache[key]
    return made[shards[g]], made[repls[i]]


def _after(order: list, u) -> Optional[FlatUnit]:
    for i, x in enumerate(order):
        if x is u:
            return order[i + 1] if i + 1 < len(order) else None
    return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _now() -> float:
    tracer = current_tracer()
    return tracer.now() if tracer is not None else 0.0


def _blocked(what: str, start: float, unit: str, phase: str) -> None:
    """Record time the compute thread was blocked on an all-gather (issuing or waiting)."""
    tracer = current_tracer()
    if tracer is not None:
        tracer.record(Event(tracer.rank, f"{what} all_gather", "wait", start, tracer.now(),
                            args={"unit": unit, "phase": phase}))


def _span(name: str, start: float, unit: str) -> None:
    tracer = current_tracer()
    if tracer is not None and start:
        tracer.record(Event(tracer.rank, name, COMPUTE, start, tracer.now(),
                            args={"unit": unit}))
