"""Flat units and the sharded data-parallel base class that ZeRO-1/2
(:mod:`labkit.parallel.zero`) and ZeRO-3 / FSDP (:mod:`labkit.parallel.fsdp`) share.

A **flat unit** (:class:`FlatUnit`) per transformer block, plus one *root* unit for every
parameter outside the blocks (embedding, final norm, head; a tied embedding/head pair is
one parameter, so it lives there once). A unit's parameters are packed into one padded 1-D
buffer ``flat`` of ``P = K·k`` elements (``K`` ranks in the shard group), the layout of
FSDP's ``FlatParameter`` (Zhao et al. 2023, "PyTorch FSDP", §3.2.1). The wrapped modules no
longer own ``nn.Parameter`` s: before forward their weights are re-installed as views
``torch.split(flat)[i].view(shape)``, so autograd accumulates the whole unit's gradient into
``flat.grad`` and runs ``flat``'s post-accumulate-grad hook exactly once, when the unit's
backward is complete — that hook is the "bucket is ready" signal. Each rank owns the
contiguous slice ``[r·k, (r+1)·k)`` (its *shard*); ``torch.optim.AdamW`` is given only the
shards, so its state is truly ``8Ψ/K`` bytes.

:class:`ShardedDataParallel` is what every stage does with them: reduce-scatter (mean) each
unit's gradient when ready, HSDP all-reduce, AdamW over the shards, full state for checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..trace import current_tracer, use_tracer
from .dp import unique_parameters

__all__ = ["FlatUnit", "ShardedDataParallel", "build_units"]


@dataclass
class _Entry:
    name: str                      # fully qualified name in the original module
    shape: torch.Size
    numel: int
    offset: int                    # into the unit's flat buffer
    owners: list = field(default_factory=list)   # (module, attribute) pairs sharing it


class FlatUnit(nn.Module):
    """One unit's parameters, flattened, padded and sharded over the shard group.

    Shapes: ``numel`` real elements padded to ``padded = K·k``; this rank owns
    ``flat[lo:hi]``, ``lo = r·k``. ``flat`` is an ``nn.Parameter`` (stages 1–2, replicated)
    or a plain leaf tensor whose storage is allocated only while gathered (stage 3).
    ``shard`` (``nn.Parameter``, ``k`` elements, parameter dtype) is what this rank keeps;
    ``master`` (fp32) is what the optimizer updates (``shard`` itself in fp32).
    """

    def __init__(self, name: str, module: nn.Module, entries: list, shard_group, *,
                 sharded_params: bool, param_dtype: torch.dtype, device):
        super().__init__()
        self.name, self.entries, self._module = name, entries, [module]
        k_ranks, r = comm.group_size(shard_group), dist.get_rank(shard_group)
        self.numel = sum(e.numel for e in entries)
        self.padded = -(-self.numel // k_ranks) * k_ranks
        self.k = self.padded // k_ranks
        self.lo, self.hi = r * self.k, (r + 1) * self.k
        data = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for e in entries:
            data[e.offset:e.offset + e.numel].copy_(e.owners[0][0]._parameters[e.owners[0][1]]
                                                    .detach().reshape(-1))
        mixed = param_dtype != torch.float32
        if sharded_params:
            self.flat = torch.empty(self.padded, dtype=param_dtype, device=device)
            self.flat.requires_grad_()
            self.flat.untyped_storage().resize_(0)
            self.shard = nn.Parameter(data[self.lo:self.hi].to(param_dtype, copy=True))
        else:
            self.flat = nn.Parameter(data.to(param_dtype, copy=True))
            self.shard = nn.Parameter(self.flat.data[self.lo:self.hi])
        # not registered: MemTracker would call it a parameter; it is optimizer state
        self.__dict__["master"] = (nn.Parameter(data[self.lo:self.hi].clone()) if mixed
                                   else self.shard)
        self.grad_shard: Optional[torch.Tensor] = None
        self.fresh = True         # next reduce-scatter overwrites the gradient shard
        self.reduced = False      # reduce-scattered in this step
        self.gathered = not sharded_params
        self.handle = None        # in-flight all-gather (stage 3)
        self.bw_started = False
        self.t_compute = 0.0

    @property
    def module(self) -> nn.Module:
        return self._module[0]

    def install_views(self) -> None:
        """Point every owner attribute at its view of ``flat`` (autograd-tracked)."""
        sizes = [e.numel for e in self.entries]
        if self.padded > self.numel:
            sizes.append(self.padded - self.numel)
        for e, v in zip(self.entries, torch.split(self.flat, sizes)):
            view = v.view(e.shape)
            for mod, attr in e.owners:
                mod.__dict__[attr] = view

    def extra_repr(self) -> str:
        return f"{self.name}: {self.numel} params, padded {self.padded}, shard {self.k}"


def build_units(module: nn.Module, unit_modules: list, shard_group, *, sharded_params: bool,
                param_dtype: torch.dtype) -> list:
    """Move ``module``'s parameters into flat units: one per entry of ``unit_modules`` (its
    parameters not shared with another unit) plus, first, a ``"root"`` unit for the rest.

    Every parameter is packed once (tied parameters: one entry, several owners) in
    ``unique_parameters`` order; units without parameters are skipped. The owners lose
    their ``nn.Parameter`` (popped from ``_parameters``); replicated units (not
    ``sharded_params``) get their views installed at once. Returns the ``FlatUnit`` list.
    """
    fqn = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    owner_unit = {id(sub): i for i, um in enumerate(unit_modules) for sub in um.modules()}
    owners: dict = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None and p.requires_grad:
                owners.setdefault(id(p), []).append((mod, attr))
    groups: dict = {}
    for name, p in unique_parameters(module):
        where = {owner_unit.get(id(m)) for m, _ in owners[id(p)]}
        idx = where.pop() if len(where) == 1 else None
        groups.setdefault(idx, []).append(_Entry(name, p.shape, p.numel(), 0, owners[id(p)]))
    out = []
    for idx in [None] + list(range(len(unit_modules))):
        entries = groups.get(idx)
        if not entries:
            continue
        off = 0
        for e in entries:
            e.offset, off = off, off + e.numel
        mod = module if idx is None else unit_modules[idx]
        name = "root" if idx is None else fqn.get(id(mod), f"unit{idx}")
        dev = entries[0].owners[0][0]._parameters[entries[0].owners[0][1]].device
        out.append(FlatUnit(name, mod, entries, shard_group, sharded_params=sharded_params,
                            param_dtype=param_dtype, device=dev))
    for u in out:
        for e in u.entries:
            for mod, attr in e.owners:
                mod._parameters.pop(attr, None)
        if u.gathered:
            u.install_views()
    return out


class ShardedDataParallel(nn.Module):
    """Shared machinery of ZeRO-1/2 (:class:`labkit.parallel.zero.ZeroDataParallel`) and ZeRO-3
    (:class:`labkit.parallel.fsdp.FullyShardedDataParallel`).

    Per step: ``forward`` + ``backward`` (per microbatch; stage 1 syncs only where
    ``require_sync`` is set, e.g. the last microbatch), ``finish_gradient_sync()``,
    ``optimizer.step()``, ``after_step()``, ``zero_grad()``. Use :meth:`optimizer` to build
    AdamW over the shards. Subclasses provide ``forward`` (install or gather the unit views,
    then run ``module``) and ``after_step`` (bring the updated shards back).

    Args:
        module: the model; its ``nn.Parameter`` s are moved into the units.
        shard_group: the ``K`` ranks that shard the model state (default: world).
        replicate_group: the ``M`` HSDP replicas of this rank (``None``: no HSDP).
        stage: 1, 2 or 3.
        mixed_precision: bf16 parameters/gradients, fp32 master shards.
        units: modules that are units (default ``module.layers``); the rest is the root.
        max_inflight: stages 2–3: reduce-scatters in flight before the oldest is waited.

    Raises:
        ValueError: a stage outside 1–3 or ``max_inflight < 1``.
    """

    def __init__(self, module: nn.Module, shard_group=None, replicate_group=None, *,
                 stage: int, mixed_precision: bool = False,
                 units: Optional[Sequence[nn.Module]] = None, max_inflight: int = 1,
                 axis: str = "dp"):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 here, got {stage!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.module, self.stage, self.axis = module, stage, axis
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.param_dtype = torch.bfloat16 if mixed_precision else torch.float32
        self.mixed_precision, self.max_inflight = mixed_precision, max_inflight
        self.require_sync = True
        self._tracer = None
        self.names = [n for n, _ in unique_parameters(module)]
        self.n_params = sum(p.numel() for _, p in unique_parameters(module))
        self._pending: list = []
        self.inflight_grad_bytes = self.max_inflight_grad_bytes = 0
        self.units = nn.ModuleList(build_units(
            module, list(units) if units is not None else list(getattr(module, "layers", [])),
            shard_group, sharded_params=stage == 3, param_dtype=self.param_dtype))
        for u in self.units:
            if stage >= 2:
                u.grad_shard = torch.zeros(u.k, dtype=self.param_dtype, device=u.shard.device)
                u.shard.grad = u.grad_shard  # persistent: MemTracker sees a gradient
            u.flat.register_post_accumulate_grad_hook(self._hook(u))

    # -- public ----------------------------------------------------------------------
    def optimizer(self, lr: float = 1e-3, weight_decay: float = 0.0) -> torch.optim.Optimizer:
        """``torch.optim.AdamW`` over this rank's fp32 master shards (state 8Ψ/K bytes)."""
        return torch.optim.AdamW([u.master for u in self.units], lr=lr,
                                 weight_decay=weight_decay)

    def finish_gradient_sync(self) -> None:
        """Complete the reduce-scatters (and HSDP all-reduces); leave the mean gradient
        shard where the optimizer reads it."""
        self._drain()
        for u in self.units:  # a unit that received no gradient still joins the collective
            if not u.reduced:
                if u.flat.grad is None:
                    u.flat.grad = torch.zeros(u.padded, dtype=self.param_dtype,
                                              device=u.shard.device)
                self._reduce_scatter(u)
        self._drain()
        grads = [self._step_grad(u) for u in self.units]
        if self.replicate_group is not None:
            hs = [comm.all_reduce(g, op="avg", group=self.replicate_group, axis=self.axis,
                                  async_op=True, unit=u.name, mesh_dim="replicate")
                  for u, g in zip(self.units, grads)]
            for h in hs:
                h.wait()
        if self.mixed_precision:
            for u, g in zip(self.units, grads):
                u.master.grad = g.float()

    def zero_grad(self) -> None:
        """Forget this step's gradients (stages 2–3 keep their shard buffers allocated)."""
        for u in self.units:
            u.fresh, u.reduced = True, False
            if self.stage == 1:
                u.flat.grad = None
                u.shard.grad = None
            if self.mixed_precision:
                u.master.grad = None

    def full_state(self) -> torch.Tensor:
        """All parameters (fp32 masters, gathered), flattened in the original module's
        ``unique_parameters`` order: comparable to ``labkit.train.flat_params``."""
        return self._gather_named(lambda u: u.master.detach())

    def full_state_dict(self) -> dict:
        """``{name: full fp32 parameter}`` (gathered masters; for parity checks)."""
        return self._gather_named(lambda u: u.master.detach(), as_dict=True)

    def full_grads(self) -> dict:
        """``{name: mean gradient}`` after ``finish_gradient_sync`` (gathered; for tests)."""
        return self._gather_named(lambda u: self._step_grad(u).float(), as_dict=True)

    @property
    def shard_bytes(self) -> dict:
        """Bytes this rank holds per role: parameters, gradient shards, master weights."""
        el = torch.tensor([], dtype=self.param_dtype).element_size()
        params = sum((u.padded if self.stage < 3 else u.k) * el for u in self.units)
        grads = sum(u.k * el for u in self.units) if self.stage >= 2 else 0
        master = sum(u.k * 4 for u in self.units) if self.mixed_precision else 0
        return {"parameters": params, "gradients": grads, "master": master}

    # -- internals ---------------------------------------------------------------------
    def _gather_named(self, fn, as_dict: bool = False):
        parts = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=torch.float32, device=u.shard.device)
            comm.all_gather(full, fn(u).contiguous(), group=self.shard_group, axis=self.axis)
            for e in u.entries:
                parts[e.name] = full[e.offset:e.offset + e.numel].view(e.shape).clone()
        if as_dict:
            return parts
        return torch.cat([parts[n].reshape(-1).cpu() for n in self.names])

    def _step_grad(self, u: FlatUnit) -> torch.Tensor:
        """The mean gradient shard the optimizer reads (stages 2–3: the shard buffer)."""
        return u.grad_shard

    def _hook(self, u: FlatUnit):
        """``flat``'s post-accumulate-grad hook: the unit's gradient is complete."""
        return lambda flat: self._traced(self._post_backward, u)

    def _traced(self, fn, *args):
        """Run a hook under the job's tracer: on CUDA autograd runs hooks on its own device
        thread, where the job's context variable is not set."""
        if current_tracer() is None and self._tracer is not None:
            with use_tracer(self._tracer):
                return fn(*args)
        return fn(*args)

    def _post_backward(self, u: FlatUnit) -> None:
        self._reduce_scatter(u)

    def _reduce_scatter(self, u: FlatUnit) -> None:
        g = u.flat.grad
        if self.stage == 1 or not u.fresh:
            out = torch.empty(u.k, dtype=g.dtype, device=g.device)
        else:
            out = u.grad_shard
        h = comm.reduce_scatter(out, g, op="avg", group=self.shard_group, axis=self.axis,
                                async_op=True, unit=u.name, mesh_dim="shard")
        u.fresh, u.reduced = False, True
        self._pending.append((u, h, out))
        self.inflight_grad_bytes += comm.nbytes(g)
        self.max_inflight_grad_bytes = max(self.max_inflight_grad_bytes,
                                           self.inflight_grad_bytes)
        if self.stage >= 2:
            while len(self._pending) > self.max_inflight:
                self._complete(self._pending.pop(0))

    def _complete(self, rec) -> None:
        u, h, out = rec
        h.wait()
        self.inflight_grad_bytes -= comm.nbytes(u.flat.grad)
        if out is not u.grad_shard:
            u.grad_shard.add_(out)
        u.flat.grad = None  # the unit's full gradient is gone (stage 2/3)

    def _drain(self) -> None:
        while self._pending:
            self._complete(self._pending.pop(0))
