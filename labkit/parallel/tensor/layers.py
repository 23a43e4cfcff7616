"""Column- and row-parallel linear layers, and the norm of a tensor-parallel block.

Megatron-LM's split of a linear layer ``Y = X Wᵀ`` (Shoeybi et al. 2019, §3):

* **column-parallel** — rank ``r`` of ``T`` holds rows ``[r·O/T, (r+1)·O/T)`` of ``W``
  ``(O, I)`` (output features), sees the whole input and produces its slice of the output
  features. Input enters through ``f`` (identity forward, all-reduce backward), or with
  sequence parallelism through an all-gather along the sequence (Korthikanti et al. 2022,
  §4.2.2).
* **row-parallel** — rank ``r`` holds columns ``[r·I/T, (r+1)·I/T)`` of ``W`` (input
  features), takes the matching slice of a column-parallel output, and produces a partial
  sum of ``Y``, completed by ``g`` (all-reduce) or with sequence parallelism by a
  reduce-scatter along the sequence.

A column-parallel layer feeding a row-parallel one needs nothing in between (claim C24): the
element-wise work on the ``O/T`` features is local. Several column-parallel weights that share
one input (the Q/K/V projections; SwiGLU's gate and up) share one ``f`` or all-gather: in
:func:`column_matmuls` the input crosses the boundary once, as Megatron's fused QKV does.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...models.gpt import compute_dtype
from ...models.norm import rms_norm
from .functions import (copy_to_tp, gather_from_sp, gather_seq, reduce_from_tp,
                        reduce_scatter_to_sp, start_gather_seq, start_scatter_seq, tp_size)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm", "column_matmuls",
           "row_output", "shard_rows", "shard_cols"]


def shard_rows(w: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows ``[rank·R/n, (rank+1)·R/n)`` of ``w`` ``(R, C)``, a contiguous copy."""
    k = w.shape[0] // n
    return w.detach()[rank * k:(rank + 1) * k].clone()


def shard_cols(w: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Columns ``[rank·C/n, (rank+1)·C/n)`` of ``w`` ``(R, C)``, a contiguous copy."""
    k = w.shape[1] // n
    return w.detach()[:, rank * k:(rank + 1) * k].contiguous().clone()


class _RegatherColumnMatmuls(torch.autograd.Function):
    """Sequence-parallel column matmuls that keep only the ``(B, S/T, H)`` input shard for
    backward and all-gather it again there (Korthikanti et al. 2022, §4.2.2: store the
    sequence-parallel part of the input, an extra all-gather in backward), instead of the
    gathered ``(B, S, H)``. Forward: all-gather, ``Y_j = X W_jᵀ``. Backward: all-gather ``X``
    again for ``dW_j = dY_jᵀ X``, and reduce-scatter ``dX = Σ_j dY_j W_j``; both
    collectives are issued asynchronously and overlap compute, as in Megatron-LM (§4.2.2):
    the all-gather runs while ``dX`` is computed, the reduce-scatter while the ``dW_j`` are.

    Under autocast the matmuls run in autocast's dtype ``c`` as they would outside this
    Function: the shard is kept (and re-gathered) in ``c``, the weights are cast to ``c``,
    ``dX_j`` and ``dW_j`` are computed in ``c`` and cast back to the input's and weights'
    dtypes before they are summed, as autograd's cast nodes would (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication`` keeps the 16-bit shard alike)."""

    @staticmethod
    def forward(ctx, x_local, group, tags, *weights):
        ctx.group, ctx.tags, ctx.in_dtype = group, tags, x_local.dtype
        x = compute_dtype(gather_seq(x_local, group, {**tags, "phase": "forward"}))
        ctx.save_for_backward(compute_dtype(x_local), *weights)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x_local, *weights = ctx.saved_tensors
        bwd = {**ctx.tags, "phase": "backward"}
        c = x_local.dtype
        # Megatron-LM's overlap (Korthikanti et al. 2022 §4.2.2; Megatron-LM's
        # LinearWithGradAccumulationAndAsyncCommunication): the re-gather of the kept shard
        # runs on the backend's thread while dX = Σ_j dY_j W_j is computed, and the
        # reduce-scatter of dX while dW_j = dY_jᵀ X is
        gathered = start_gather_seq(x_local, ctx.group, {**bwd, "regather": True})
        gx = None
        for g, w in zip(grads, weights):
            part = (g.to(c) @ w.to(c)).to(ctx.in_dtype)
            gx = part if gx is None else gx + part
        x = gathered()
        scattered = start_scatter_seq(gx, ctx.group, bwd)
        del gx
        x2 = x.reshape(-1, x.shape[-1])
        gws = [(g.to(c).reshape(-1, g.shape[-1]).t() @ x2).to(w.dtype)
               for g, w in zip(grads, weights)]
        return (scattered(), None, None, *gws)


def column_matmuls(x: torch.Tensor, weights: Sequence[torch.Tensor], group, *,
                   sequence_parallel: bool = False, regather: bool = False,
                   **tags) -> tuple:
    """``X W_jᵀ`` for column-parallel weights ``W_j`` ``(O_j/T, I)`` sharing one input.

    ``x`` is ``(B, S, I)`` (replicated), or ``(B, S/T, I)`` with ``sequence_parallel``; it
    crosses into the tp region once (``f``, or one all-gather) and, under autocast, is cast
    once, so backward keeps one copy of it for all the weights
    (:func:`labkit.models.gpt.compute_dtype`). With ``regather`` (sequence parallel only)
    backward keeps the ``S/T`` shard and all-gathers it again. Returns one ``(B, S, O_j/T)``
    tensor per weight.
    """
    if sequence_parallel and regather and tp_size(group) > 1:
        return _RegatherColumnMatmuls.apply(x, group, tags, *weights)
    x = gather_from_sp(x, group, **tags) if sequence_parallel else copy_to_tp(x, group, **tags)
    x = compute_dtype(x)
    return tuple(F.linear(x, w) for w in weights)


def row_output(y: torch.Tensor, group, *, sequence_parallel: bool = False,
               **tags) -> torch.Tensor:
    """Complete a row-parallel partial sum ``(B, S, O)``: all-reduce (``g``) → ``(B, S, O)``,
    or with ``sequence_parallel`` reduce-scatter → ``(B, S/T, O)``."""
    if sequence_parallel:
        return reduce_scatter_to_sp(y, group, **tags)
    return reduce_from_tp(y, group, **tags)


class ColumnParallelLinear(nn.Module):
    """Column-parallel linear: ``weight`` ``(O/T, I)`` is this rank's output rows, ``bias``
    (optional) ``(O/T,)`` the matching output features (Shoeybi et al. 2019, §3: the bias
    is split with the output features, so its gradient is complete on each rank).

    ``forward(x)``: ``x`` ``(B, S, I)`` (or ``(B, S/T, I)`` with sequence parallelism) →
    ``(B, S, O/T)``, the input entering the tp region through ``f`` / an all-gather.
    Built by :meth:`from_linear` from a full ``nn.Linear``.
    """

    def __init__(self, weight: nn.Parameter, group, *, sequence_parallel: bool = False,
                 regather: bool = False, tags: dict | None = None,
                 bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.tags = dict(tags or {})

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, rank: int, **kw) -> "ColumnParallelLinear":
        """Rank ``rank``'s shard of ``linear`` (its bias too, sliced like the rows)."""
        n = tp_size(group)
        b = getattr(linear, "bias", None)
        bias = None if b is None else nn.Parameter(shard_rows(b, rank, n))
        return cls(nn.Parameter(shard_rows(linear.weight, rank, n)), group, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_matmuls(x, (self.weight,), self.group,
                           sequence_parallel=self.sequence_parallel,
                           regather=self.regather, **self.tags)[0]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        o, i = self.weight.shape
        return f"local_out={o}, in={i}, tp={tp_size(self.group)}"


class RowParallelLinear(nn.Module):
    """Row-parallel linear: ``weight`` ``(O, I/T)`` is this rank's input columns; ``bias``
    (optional) ``(O,)`` is whole on every rank and added once, *after* the reduction (added
    before it, the all-reduce would count it ``T`` times; Shoeybi et al. 2019, §3).

    ``forward(x)``: ``x`` ``(B, S, I/T)`` → ``(B, S, O)`` after the all-reduce ``g``, or
    ``(B, S/T, O)`` after the reduce-scatter with sequence parallelism. The bias gradient is
    the sum of the output gradient over the tokens, never divided by ``T``: after ``g`` every
    rank sees every token, so its gradient is already complete; with sequence parallelism
    each rank sees ``S/T`` tokens, so the bias enters through ``f`` (identity forward,
    all-reduce backward) and its gradient is summed over the tp ranks, as
    :class:`ParallelRMSNorm`'s weight (Korthikanti et al. 2022, §4.2.2).
    """

    def __init__(self, weight: nn.Parameter, group, *, sequence_parallel: bool = False,
                 tags: dict | None = None, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tags = dict(tags or {})

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, rank: int, **kw) -> "RowParallelLinear":
        """Rank ``rank``'s shard of ``linear`` (its bias whole: added after the reduction)."""
        n = tp_size(group)
        b = getattr(linear, "bias", None)
        bias = None if b is None else nn.Parameter(b.detach().clone())
        return cls(nn.Parameter(shard_cols(linear.weight, rank, n)), group, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_output(F.linear(x, self.weight), self.group,
                       sequence_parallel=self.sequence_parallel, **self.tags)
        if self.bias is None:
            return y
        b = copy_to_tp(self.bias, self.group, **self.tags) if self.sequence_parallel \
            else self.bias
        return y + b

    def extra_repr(self) -> str:
        o, i = self.weight.shape
        return f"out={o}, local_in={i}, tp={tp_size(self.group)}"


class ParallelRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) of a tensor-parallel model, ``(…, H)`` in and out.

    Without sequence parallelism every tp rank normalises the same ``(B, S, H)`` and receives
    the same, complete gradient (the ``f`` after it sums the input gradient), so this is
    plain RMSNorm. With sequence parallelism each rank normalises its own ``S/T`` tokens and
    its weight gradient covers only those: the weight passes through ``f`` (identity forward,
    all-reduce backward), so every rank ends backward with the full gradient summed over the
    tp group (Korthikanti et al. 2022, §4.2.2; Megatron-LM sums these "sequence-parallel
    parameters" over the tp group). Holds the norm's own ``weight`` Parameter; keeps ``x``
    and float32 ``1/rms`` for backward (:func:`labkit.models.norm.rms_norm`).
    """

    def __init__(self, norm: nn.Module, group, *, sequence_parallel: bool = False,
                 tags: dict | None = None):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tags = dict(tags or {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tp(self.weight, self.group, **self.tags) if self.sequence_parallel \
            else self.weight
        return rms_norm(x, w, self.eps)
