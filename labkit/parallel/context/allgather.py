"""All-gather K/V context parallelism: the variant Llama 3 trained its long-context stage with.

Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2 (context parallelism): each rank
holds two chunks of the sequence (the zigzag split, :mod:`.layout`); the K and V tensors are
all-gathered over the context-parallel group and each rank computes attention for its local
queries against the whole K/V, then reduce-scatters the K/V gradients in backward. They chose
it over ring attention because an all-gather is simple to pair with any attention mask and
K/V are small under grouped-query attention (8 K/V heads for 128 query heads), so gathering
them costs little and hides poorly only for short sequences.

Here: :class:`AllGatherKV` (forward all-gather, backward reduce-scatter, Megatron-style
f/g pair) moves K and V stacked into one ``(2, B, K, S/cp, D)`` tensor; attention is
:class:`.blocks.LocalAttention` with the gathered chunks in rank order, so causal blocks
are classified by global chunk index exactly as in the ring. Bytes per rank and attention
call: forward ``(cp−1)·2·|k|`` (all-gather), backward the same (reduce-scatter).
The K/V working set is the whole sequence's K/V, ``cp·2·|k|``.
"""
from __future__ import annotations

import torch

from ... import comm
from .blocks import AttentionSpec, LocalAttention, WorkCounter

__all__ = ["AllGatherKV", "allgather_attention"]


class AllGatherKV(torch.autograd.Function):
    """Forward: all-gather ``kv`` ``(2, B, K, s, D)`` over ``group`` → ``(2, B, K, cp·s, D)``,
    sequence in group-rank order. Backward: reduce-scatter (sum) of the gradient, so each
    rank gets the sum over every rank's queries of its own chunk's ``dK``/``dV``.

    Source: Dubey et al. 2024 §3.3.2 (all-gather K/V, reduce-scatter dK/dV); the pairing of a
    collective with its adjoint as one autograd Function follows Shoeybi et al. 2019
    (Megatron-LM §3, the ``f``/``g`` operators).
    """

    @staticmethod
    def forward(ctx, kv, group, cp: int):
        ctx.group, ctx.cp = group, cp
        if cp == 1:
            return kv.clone()
        two, b, h, s, d = kv.shape
        # the tensor form concatenates along dim 0: (cp·2, B, K, s, D)
        gathered = torch.empty((cp * two, b, h, s, d), dtype=kv.dtype, device=kv.device)
        comm.all_gather(gathered, kv.contiguous(), group, axis="cp", phase="forward",
                        what="kv")
        # (cp, 2, B, K, s, D) -> (2, B, K, cp·s, D): rank j's chunks at sequence block j
        return gathered.view(cp, two, b, h, s, d).permute(1, 2, 3, 0, 4, 5).reshape(
            two, b, h, cp * s, d)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        if cp == 1:
            return grad, None, None
        two, b, h, cps, d = grad.shape
        per_rank = grad.reshape(two, b, h, cp, cps // cp, d).permute(3, 0, 1, 2, 4, 5)
        out = torch.empty((two, b, h, cps // cp, d), dtype=grad.dtype, device=grad.device)
        comm.reduce_scatter(out, per_rank.reshape(cp * two, b, h, cps // cp, d), "sum",
                            ctx.group, axis="cp",
                            phase="backward", what="dkv")
        return out, None, None


def allgather_attention(q, k, v, *, group, cp: int, chunks: tuple, rank: int,
                        chunk_len: int, causal: bool, counter: WorkCounter):
    """Local queries ``q`` ``(B, A, S/cp, D)`` against the all-gathered ``k``/``v``
    (``(B, K, S/cp, D)`` each, this rank's part) → ``(B, A, S/cp, D)``.

    ``chunks[j]`` are the global chunk indices rank ``j`` holds (:func:`.layout.chunk_ids`).
    """
    kv = AllGatherKV.apply(torch.stack([k, v]), group, cp)
    kv_chunks = tuple(cid for j in range(cp) for cid in chunks[j])
    spec = AttentionSpec(chunks[rank], kv_chunks, chunk_len, causal, counter,
                         name="cp.allgather")
    return LocalAttention.apply(q, kv[0], kv[1], spec)
