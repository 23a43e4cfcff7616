"""ZeRO stages 1 and 2 from labkit's traced collectives.

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §5) removes data parallelism's redundant copies of model state. With
``Ψ`` parameters on ``N`` ranks and Adam, per rank (fp32: 4/4/8 bytes per parameter):

=======  =========================================  ==========================================
stage    what is sharded                            communication per step
=======  =========================================  ==========================================
1        optimizer state (8Ψ → 8Ψ/N)                reduce-scatter grads + all-gather params
2        + gradients (4Ψ → 4Ψ/N)                    the same, 2·(N−1)/N·Ψ·elem, as DP (§7.2.1)
3        + parameters (:mod:`labkit.parallel.zero.fsdp`)  3·(N−1)/N·Ψ·elem (§7.2.2)
=======  =========================================  ==========================================

Design: the parameters live in flat units (:mod:`labkit.parallel.zero.flat`), one per block
plus a root unit, each packed into one padded buffer ``flat`` of which every rank owns the
contiguous ``k = P/K`` element shard; AdamW sees only the shards.

* **Stage 1**: ``flat`` is the replicated parameter (``nn.Parameter``, 4Ψ), the shard a view
  of it. Full gradients accumulate in ``flat.grad`` (4Ψ). In the last microbatch's backward
  each unit's gradient is reduce-scattered (mean) as soon as it and the units before it in
  the canonical order are ready; ``finish_gradient_sync`` writes the mean shard into this
  rank's chunk of ``flat.grad``; after the optimizer step the shards are all-gathered into
  ``flat``.
* **Stage 2**: as stage 1, but the reduce-scattered shard goes to a persistent ``Ψ/K``
  gradient buffer and ``flat.grad`` is dropped as soon as its reduce-scatter completes
  (at most ``max_inflight`` units' gradients exist at once), so a full gradient vector never
  exists. Gradient accumulation reduce-scatters every microbatch and adds the shards.
* **HSDP**: with a ``replicate_group`` of ``M`` ranks, the gradient shards are then
  all-reduced (mean) across the replicas: the mean over all ``M·K`` ranks.

Mixed precision (``mixed_precision=True``): ``flat``, the gradients and the traffic are
bf16; each rank keeps an fp32 master shard which AdamW updates (2 + 2 + 12 bytes/param).

Every rank must build the module identically (``labkit.models.build_model`` does); all
communication goes through :mod:`labkit.comm`. Units are ``module.layers`` unless given.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ... import comm
from ...trace import current_tracer
from .flat import FlatUnit
from ..dp.ordered import grad_stamp, same_stamp
from .sharded import ShardedDataParallel  # re-exported

__all__ = ["FlatUnit", "ShardedDataParallel", "ZeroDataParallel"]


class ZeroDataParallel(ShardedDataParallel):
    """ZeRO stage 1 or 2 (see the module docstring); ``stage`` defaults to 2.

    Args and per-step use: see :class:`labkit.parallel.zero.sharded.ShardedDataParallel`.

    Raises:
        ValueError: ``stage`` not 1 or 2 (stage 3 is
            :class:`labkit.parallel.zero.fsdp.FullyShardedDataParallel`).
    """

    def __init__(self, module: nn.Module, shard_group=None, replicate_group=None, *,
                 stage: int = 2, **kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel is ZeRO stage 1 or 2, got {stage!r}; use "
                             "labkit.parallel.zero.fsdp.FullyShardedDataParallel for stage 3")
        super().__init__(module, shard_group, replicate_group, stage=stage, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate full gradients locally (``require_sync = False``); stage 2
        reduce-scatters anyway (keeping full gradients would undo its memory saving)."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def forward(self, *args, **kwargs):
        """Install the views of the replicated ``flat`` buffers, run the module."""
        self._tracer = current_tracer()
        self._drain()
        for u in self.units:  # replicated: re-point the owners at their views of flat
            u.install_views()
        return self.module(*args, **kwargs)

    def after_step(self) -> None:
        """After ``optimizer.step()``: all-gather the updated (master) shards, cast to the
        parameter dtype, into the replicated ``flat``."""
        hs = [comm.all_gather(u.flat.data, u.master.detach().to(self.param_dtype, copy=True),
                              group=self.shard_group, axis=self.axis, async_op=True,
                              unit=u.name, phase="step", mesh_dim="shard")
              for u in self.units]
        for h in hs:
            h.wait()

    # -- stage 1 keeps the full gradient: each send carries the whole local accumulation --
    def _unsent(self, u: FlatUnit) -> bool:
        if self.stage != 1:
            return super()._unsent(u)
        return not u.reduced or not same_stamp(u.stamp, u.flat.grad)

    def _complete(self, rec) -> None:
        if self.stage != 1:
            return super()._complete(rec)
        u, h, out, g = rec
        h.wait()
        self.inflight_grad_bytes -= comm.nbytes(g)
        u.result = out  # the latest send wins; never into flat.grad, still accumulating

    def _install_results(self) -> None:
        """Stage 1: write each mean shard into this rank's chunk of the full gradient."""
        if self.stage != 1:
            return
        for u in self.units:
            if u.flat.grad is None:
                u.flat.grad = torch.zeros(u.padded, dtype=self.param_dtype,
                                          device=u.shard.device)
            chunk = u.flat.grad[u.lo:u.hi]
            chunk.copy_(u.result)
            u.shard.grad, u.result = chunk, None
            u.stamp = grad_stamp(u.flat.grad)  # what a repeated call would find unchanged

    def _step_grad(self, u: FlatUnit):
        """Stage 1: this rank's chunk of the full gradient, where the mean shard was written."""
        return u.flat.grad[u.lo:u.hi] if self.stage == 1 else u.grad_shard
