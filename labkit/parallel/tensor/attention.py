"""Tensor-parallel self-attention and SwiGLU MLP (Shoeybi et al. 2019, §3, Fig. 3).

Attention: the query heads are split over the ``T`` tp ranks (``wq`` column-parallel, ``wo``
row-parallel), so each rank runs attention on its ``A/T`` heads with no communication.
Grouped-query K/V heads (Ainslie et al. 2023):

* ``K ≥ T`` (``K`` divisible by ``T``): ``wk``/``wv`` are column-parallel like ``wq``; rank ``r``
  keeps K/V heads ``[r·K/T, (r+1)·K/T)``, exactly the ones its query heads read.
* ``K < T`` (``T`` divisible by ``K``): each K/V head serves ``T/K`` ranks' query heads. Every
  rank keeps the full ``wk``/``wv`` and uses only the rows of its one head (as vLLM and
  Megatron replicate K/V heads when ``T > K``). The weight passes through ``f`` (identity
  forward, all-reduce backward): each rank's gradient covers only its head's rows, the sum
  over the tp group is the full gradient, and every rank holds it after backward.

SwiGLU (Shazeer 2020): gate ``w1`` and up ``w3`` column-parallel, down ``w2`` row-parallel;
``silu(x W1ᵀ) ⊙ x W3ᵀ`` is element-wise on the local ``F/T`` features, so nothing is
communicated between the column and the row matmuls (claim C24).

Both keep the attribute names of :mod:`labkit.models.gpt` (``wq, wk, wv, wo, core``;
``w1, w3, w2``), so parameter names are the full model's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...models.gpt import attention_core, heads
from .functions import copy_to_tp, tp_size
from .layers import ColumnParallelLinear, RowParallelLinear, column_matmuls

__all__ = ["ParallelAttention", "ParallelSwiGLU", "ReplicatedKV"]


class ReplicatedKV(nn.Module):
    """The full K or V projection ``(K·D, H)`` held on every tp rank when ``K < T``; this
    rank reads rows ``[head·D, (head+1)·D)``, its weight gradient summed over the tp group
    (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, head: int, head_dim: int, group, tags: dict):
        super().__init__()
        self.weight, self.head, self.head_dim = weight, head, head_dim
        self.group, self.tags = group, tags

    def local_weight(self) -> torch.Tensor:
        w = copy_to_tp(self.weight, self.group, **self.tags)
        return w[self.head * self.head_dim:(self.head + 1) * self.head_dim]


class ParallelAttention(nn.Module):
    """This tp rank's share of a :class:`labkit.models.gpt.Attention`, built from the full one.

    ``forward(x, rope)``: ``x`` ``(B, S, H)``, or ``(B, S/T, H)`` with sequence parallelism;
    ``rope`` = ``(cos, sin)`` each ``(S, D/2)`` for the full sequence attention sees. Returns
    the same shape as ``x``. ``core(q, k, v)``, when set (context parallelism), receives this
    rank's heads: ``q`` ``(B, A/T, S, D)``, ``k``/``v`` ``(B, K_local, S, D)`` with
    ``K_local = K/T`` (or 1 when ``K < T``), after rotary, before any grouped-query repeat.

    Raises (at construction):
        ValueError: ``A`` not divisible by ``T``, or neither of ``K``, ``T`` divides the other.
    """

    def __init__(self, attn: nn.Module, group, rank: int, *, sequence_parallel: bool = False,
                 regather: bool = False, layer: Optional[int] = None):
        super().__init__()
        n = tp_size(group)
        a, k, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        if a % n:
            raise ValueError(f"tensor parallelism: n_heads={a} does not divide by tp={n}")
        if k % n and n % k:
            raise ValueError(f"tensor parallelism: kv_heads={k} and tp={n}: one must divide "
                             "the other")
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.causal, self.impl, self.head_dim = attn.causal, attn.impl, d
        self.n_heads = a // n                      # local query heads
        self.kv_replicated = k < n
        self.n_kv_heads = 1 if self.kv_replicated else k // n
        self.core = attn.core
        self.tags = {"layer": layer} if layer is not None else {}
        col = dict(sequence_parallel=sequence_parallel, regather=regather,
                   tags=dict(self.tags, site="attn_in"))
        self.wq = ColumnParallelLinear.from_linear(attn.wq, group, rank, **col)
        if self.kv_replicated:
            if getattr(attn.wk, "bias", None) is not None or getattr(attn.wv, "bias", None) \
                    is not None:
                raise ValueError(f"tensor parallelism: kv_heads={k} < tp={n} replicates the "
                                 "K/V weights, which is written for bias-free wk/wv; use "
                                 "tp <= kv_heads or bias=False")
            head = rank // (n // k)               # the K/V head of this rank's query heads
            self.wk = ReplicatedKV(attn.wk.weight, head, d, group, dict(self.tags, site="wk_grad"))
            self.wv = ReplicatedKV(attn.wv.weight, head, d, group, dict(self.tags, site="wv_grad"))
        else:
            self.wk = ColumnParallelLinear.from_linear(attn.wk, group, rank, **col)
            self.wv = ColumnParallelLinear.from_linear(attn.wv, group, rank, **col)
        self.wo = RowParallelLinear.from_linear(attn.wo, group, rank,
                                                sequence_parallel=sequence_parallel,
                                                tags=dict(self.tags, site="attn_out"))

    def _kv(self, m: nn.Module) -> torch.Tensor:
        return m.local_weight() if isinstance(m, ReplicatedKV) else m.weight

    def forward(self, x: torch.Tensor,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        q, k, v = with_biases(
            column_matmuls(x, (self.wq.weight, self._kv(self.wk), self._kv(self.wv)),
                           self.group, sequence_parallel=self.sequence_parallel,
                           regather=self.regather, **self.tags, site="attn_in"),
            (self.wq, self.wk, self.wv))
        b, s = q.shape[0], q.shape[1]
        if rope is not None and rope[0].shape[0] != s:
            raise ValueError(f"rotary tables cover {rope[0].shape[0]} positions but attention "
                             f"sees {s} tokens; with sequence parallelism set the "
                             "module's positions to the full sequence (rope_slice)")
        # rotary before the transpose: SDPA's output is then (B, S, A, D) in memory and wo's
        # input a view of it (labkit.models.gpt.heads)
        q = heads(q, self.n_heads, self.head_dim, rope)
        k = heads(k, self.n_kv_heads, self.head_dim, rope)
        v = heads(v, self.n_kv_heads, self.head_dim)
        if self.core is not None:
            out = self.core(q, k, v)
        else:
            out = attention_core(q, k, v, self.causal, self.impl)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


def with_biases(ys: tuple, layers: tuple) -> tuple:
    """Each column-parallel output plus its layer's bias shard (if any): the fused matmuls
    take weights only."""
    return tuple(y if getattr(m, "bias", None) is None else y + m.bias
                 for y, m in zip(ys, layers))


class ParallelSwiGLU(nn.Module):
    """This tp rank's share of a :class:`labkit.models.gpt.SwiGLU`: ``w1``/``w3``
    ``(F/T, H)`` column-parallel, ``w2`` ``(H, F/T)`` row-parallel.

    ``forward(x)``: ``(B, S, H)``, or ``(B, S/T, H)`` with sequence parallelism, in and out;
    one ``f``/all-gather before ``w1``/``w3``, one all-reduce/reduce-scatter after ``w2``.

    Raises (at construction):
        ValueError: ``F`` not divisible by ``T``.
    """

    def __init__(self, mlp: nn.Module, group, rank: int, *, sequence_parallel: bool = False,
                 regather: bool = False, layer: Optional[int] = None):
        super().__init__()
        n = tp_size(group)
        f = mlp.w1.weight.shape[0]
        if f % n:
            raise ValueError(f"tensor parallelism: ffn width {f} does not divide by tp={n}")
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.tags = {"layer": layer} if layer is not None else {}
        col = dict(sequence_parallel=sequence_parallel, regather=regather,
                   tags=dict(self.tags, site="mlp_in"))
        self.w1 = ColumnParallelLinear.from_linear(mlp.w1, group, rank, **col)
        self.w3 = ColumnParallelLinear.from_linear(mlp.w3, group, rank, **col)
        self.w2 = RowParallelLinear.from_linear(mlp.w2, group, rank,
                                                sequence_parallel=sequence_parallel,
                                                tags=dict(self.tags, site="mlp_out"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = with_biases(
            column_matmuls(x, (self.w1.weight, self.w3.weight), self.group,
                           sequence_parallel=self.sequence_parallel, regather=self.regather,
                           **self.tags, site="mlp_in"),
            (self.w1, self.w3))
        return self.w2(F.silu(gate) * up)
