"""Flat units: the parameter layout that ZeRO-1/2 (:mod:`labkit.parallel.zero`) and ZeRO-3 /
FSDP (:mod:`labkit.parallel.zero.fsdp`) share through :mod:`labkit.parallel.zero.sharded`.

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

Parameters passed as ``ignored`` stay where they are, ordinary ``nn.Parameter`` s of their
modules, in no unit (another wrapper may own them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ... import comm
from ..dp import unique_parameters

__all__ = ["FlatUnit", "build_units"]


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
        self.stamp = None         # stage 1: the accumulated gradient it last sent
        self.result: Optional[torch.Tensor] = None  # stage 1: that send's mean shard
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
                param_dtype: torch.dtype, ignored: set = frozenset()) -> list:
    """Move ``module``'s parameters into flat units: one per entry of ``unit_modules`` (its
    parameters not shared with another unit) plus, first, a ``"root"`` unit for the rest.

    Every parameter is packed once (tied parameters: one entry, several owners) in
    ``unique_parameters`` order; units without parameters are skipped. The owners lose
    their ``nn.Parameter`` (popped from ``_parameters``); replicated units (not
    ``sharded_params``) get their views installed at once. Parameters whose ``id`` is in
    ``ignored`` are left untouched. Returns the ``FlatUnit`` list.
    """
    fqn = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    owner_unit = {id(sub): i for i, um in enumerate(unit_modules) for sub in um.modules()}
    owners: dict = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None and p.requires_grad and id(p) not in ignored:
                owners.setdefault(id(p), []).append((mod, attr))
    groups: dict = {}
    for name, p in unique_parameters(module, [q for q in module.parameters()
                                              if id(q) in ignored]):
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
