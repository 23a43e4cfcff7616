"""The sharded data-parallel base class that ZeRO-1/2 (:mod:`labkit.parallel.zero`) and
ZeRO-3 / FSDP (:mod:`labkit.parallel.zero.fsdp`) share: reduce-scatter each flat unit's
(:mod:`labkit.parallel.zero.flat`) gradient, HSDP all-reduce, AdamW over the shards, full state
for checks.

Order. Reduce-scatters go out in one canonical unit order on every rank — the reverse of
the unit list, i.e. last block first and the root (whose embedding gradient completes last)
at the end — through a :class:`~labkit.parallel.dp.ordered.CollectiveProgram` per synced
backward: a unit whose gradient is ready waits for the units before it. When the backward
ends, units that received no gradient in it send what they hold (zeros at least), so every
rank has issued the same collectives before anything else runs.

Unused parameters. A flat unit has one gradient for all its parameters, so a parameter no
rank used gets zeros there, and AdamW's decoupled weight decay (and, after the first step,
its momentum) still moves it; torch DDP (``find_unused_parameters=True``, and labkit's
:class:`~labkit.parallel.dp.DataParallel` ``find_unused``) leave its ``grad`` None and the
optimizer skips it. Freeze such parameters (``requires_grad=False``) or pass them as
``ignored_params``. A parameter some ranks used gets the mean (sum) with zeros from the
others, as under DDP (tests/test_dp_wrappers.py checks both against torch DDP).

Accumulation, any pattern. Stages 2–3 reduce-scatter every microbatch and *add* the mean
shards (their full gradient is dropped each time). Stage 1 keeps the full gradient: a
synced backward reduce-scatters the whole local accumulation into a separate result, never
into the gradient being accumulated, and ``finish_gradient_sync`` re-sends every unit whose
gradient changed after its last send (identity and in-place version) or that was never
sent — so all-microbatches-unsynced, synced-every-time and mixed steps, and gradients
written into ``flat.grad`` without a hook, all end in the same mean.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from ... import comm
from ...trace import current_tracer, use_tracer
from ..dp import check_reduce_op, ignored_ids, unique_parameters
from .flat import FlatUnit, build_units
from ..dp.ordered import CollectiveProgram, at_end_of_backward, grad_stamp

__all__ = ["ShardedDataParallel"]


class ShardedDataParallel(nn.Module):
    """Shared machinery of ZeRO-1/2 (:class:`labkit.parallel.zero.ZeroDataParallel`) and ZeRO-3
    (:class:`labkit.parallel.zero.fsdp.FullyShardedDataParallel`).

    Per step: ``forward`` + ``backward`` per microbatch (stage 1 syncs only where
    ``require_sync`` is set), ``finish_gradient_sync()``, ``optimizer.step()``,
    ``after_step()``, ``zero_grad()``. Use :meth:`optimizer` to build AdamW over the shards.
    Subclasses provide ``forward`` (install or gather the unit views, then run ``module``)
    and ``after_step`` (bring the updated shards back).

    Args:
        module: the model; its ``nn.Parameter`` s are moved into the units.
        shard_group: the ``K`` ranks that shard the model state (default: world).
        replicate_group: the ``M`` HSDP replicas of this rank (``None``: no HSDP).
        stage: 1, 2 or 3.
        mixed_precision: bf16 parameters/gradients, fp32 master shards.
        units: modules that are units (default ``module.layers``); the rest is the root.
        max_inflight: stages 2–3: reduce-scatters in flight before the oldest is waited.
        reduce_op: ``"avg"`` (mean over all ``M·K`` ranks, as FSDP) or ``"sum"`` — for the
            reduce-scatter and the HSDP all-reduce alike.
        ignored_params: parameters left out of every unit: they stay ordinary parameters
            of their modules, with no hook and no communication.

    Raises:
        ValueError: a stage outside 1–3, ``max_inflight < 1``, an unknown ``reduce_op``,
            an ignored parameter that is not the module's.
    """

    def __init__(self, module: nn.Module, shard_group=None, replicate_group=None, *,
                 stage: int, mixed_precision: bool = False,
                 units: Optional[Sequence[nn.Module]] = None, max_inflight: int = 1,
                 axis: str = "dp", reduce_op: str = "avg", ignored_params: Iterable = ()):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 here, got {stage!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.reduce_op = check_reduce_op(reduce_op)
        ignored = ignored_ids(module, ignored_params)
        self.module, self.stage, self.axis = module, stage, axis
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.param_dtype = torch.bfloat16 if mixed_precision else torch.float32
        self.mixed_precision, self.max_inflight = mixed_precision, max_inflight
        self.require_sync = True
        self._tracer = None
        mine = [(n, p) for n, p in unique_parameters(module) if id(p) not in ignored]
        self.names = [n for n, _ in mine]
        self.n_params = sum(p.numel() for _, p in mine)
        self._pending: list = []
        self._round: Optional[CollectiveProgram] = None
        self._synced = False
        self.inflight_grad_bytes = self.max_inflight_grad_bytes = 0
        self.units = nn.ModuleList(build_units(
            module, list(units) if units is not None else list(getattr(module, "layers", [])),
            shard_group, sharded_params=stage == 3, param_dtype=self.param_dtype,
            ignored=ignored))
        self.reduce_order = list(reversed(self.units))
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
        """Complete the reduce-scatters (and HSDP all-reduces); leave the mean (or sum)
        gradient shard where the optimizer reads it. Units whose gradient was never sent
        this step, or changed since (also without any hook firing), are sent now, in the
        canonical order.

        Raises:
            RuntimeError: nothing changed since the previous call (a second sync of the
                same gradients would reduce them again).
        """
        if self._round is not None:
            self._end_round()
        self._drain()
        todo = [u for u in self.reduce_order if self._unsent(u)]
        if self._synced and not todo:
            raise RuntimeError("sharded data parallel: finish_gradient_sync() again without "
                               "a backward in between; call zero_grad() and run a backward")
        for u in todo:
            self._reduce_scatter(u)
        self._drain()
        self._install_results()
        grads = [self._step_grad(u) for u in self.units]
        if self.replicate_group is not None:
            hs = [comm.all_reduce(g, op=self.reduce_op, group=self.replicate_group,
                                  axis=self.axis, async_op=True, unit=u.name,
                                  mesh_dim="replicate")
                  for u, g in zip(self.units, grads)]
            for h in hs:
                h.wait()
        if self.mixed_precision:
            for u, g in zip(self.units, grads):
                u.master.grad = g.float()
        self._synced = True

    def zero_grad(self) -> None:
        """Forget this step's gradients (stages 2–3 keep their shard buffers allocated)."""
        for u in self.units:
            u.fresh, u.reduced, u.stamp, u.result = True, False, None, None
            if self.stage == 1:
                u.flat.grad = None
                u.shard.grad = None
            if self.mixed_precision:
                u.master.grad = None
        self._synced = False

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

    def _unsent(self, u: FlatUnit) -> bool:
        """Does ``u`` hold gradient that no reduce-scatter of this step has carried? (Stages
        2–3 drop ``flat.grad`` once it is sent, so any left is new.)"""
        return not u.reduced or u.flat.grad is not None

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

    def _syncs(self) -> bool:
        """Does a backward now reduce-scatter? Stage 1 only where ``require_sync`` is set;
        stage 2 always (keeping full gradients would undo its memory saving)."""
        return self.require_sync or self.stage == 2

    def _post_backward(self, u: FlatUnit) -> None:
        if not self._syncs():
            return  # the full gradient accumulates locally until a synced backward
        self._begin_round().mark_ready(("rs", u))

    def _begin_round(self) -> CollectiveProgram:
        """The program of the backward now running (created by its first hook)."""
        if self._round is None:
            self._round = CollectiveProgram(self._round_ops(), self._issue,
                                            pull=self._round_pulls(),
                                            describe=lambda op: f"{op[0]} {op[1].name}")
            at_end_of_backward(lambda: self._traced(self._end_round))
        return self._round

    def _round_ops(self) -> list:
        return [("rs", u) for u in self.reduce_order]

    def _round_pulls(self) -> list:
        return []

    def _issue(self, op) -> None:
        self._reduce_scatter(op[1])

    def _end_round(self) -> None:
        """The backward ended: issue what is left of its program, in order, and wait."""
        rnd, self._round = self._round, None
        rnd.flush()
        self._drain()

    def _reduce_scatter(self, u: FlatUnit) -> None:
        g = u.flat.grad
        if g is None:  # no gradient reached this unit: it still joins the collective
            g = torch.zeros(u.padded, dtype=self.param_dtype, device=u.shard.device)
        if self.stage == 1 or not u.fresh:
            out = torch.empty(u.k, dtype=g.dtype, device=g.device)
        else:
            out = u.grad_shard
        u.stamp = grad_stamp(u.flat.grad)
        h = comm.reduce_scatter(out, g, op=self.reduce_op, group=self.shard_group,
                                axis=self.axis, async_op=True, unit=u.name, mesh_dim="shard")
        u.fresh, u.reduced, self._synced = False, True, False
        self._pending.append((u, h, out, g))
        self.inflight_grad_bytes += comm.nbytes(g)
        self.max_inflight_grad_bytes = max(self.max_inflight_grad_bytes,
                                           self.inflight_grad_bytes)
        if self.stage >= 2:
            while len(self._pending) > self.max_inflight:
                self._complete(self._pending.pop(0))

    def _complete(self, rec) -> None:
        u, h, out, g = rec
        h.wait()
        self.inflight_grad_bytes -= comm.nbytes(g)
        if out is not u.grad_shard:
            u.grad_shard.add_(out)
        if u.flat.grad is g:
            u.flat.grad = None  # the unit's full gradient is gone (stage 2/3)

    def _install_results(self) -> None:
        """After the last reduce-scatter: put the results where ``_step_grad`` reads them
        (stages 2–3: already in the gradient shards)."""

    def _drain(self) -> None:
        while self._pending:
            self._complete(self._pending.pop(0))
