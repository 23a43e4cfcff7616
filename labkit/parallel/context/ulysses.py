"""DeepSpeed-Ulysses: trade the sequence split for a head split around attention.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models", §3: before attention an all-to-all turns Q, K, V
from sequence-sharded ``(B, heads, S/cp, D)`` into head-sharded ``(B, heads/cp, S, D)``;
each rank then runs ordinary attention over the whole sequence for its ``heads/cp`` heads,
and a second all-to-all turns the output back. Communication per rank is
``(cp−1)/cp`` of what it sends, independent of the number of ranks per token (§3.2).

Grouped-query attention: K/V heads are split the same way, so each rank needs
``K/cp`` whole K/V heads and its ``A/cp`` query heads must be exactly the ones that share
them. Contiguous head blocks do that when ``cp`` divides ``K``: query heads
``[j·A/cp, (j+1)·A/cp)`` use K/V heads ``[j·K/cp, (j+1)·K/cp)``. When ``cp`` does not divide
the K/V heads (after tensor parallelism), labkit refuses before launch
(:func:`.core.check_context_parallel`) rather than replicating K/V heads silently.

The head-sharded sequence holds every rank's chunks in rank order, so causal blocks are
classified by global chunk index; with the zigzag split each rank still sees the whole
sequence, and every rank does the same ``1/cp`` of the work whatever the split.

Bytes per rank and attention call (tensors in this rank's sequence-sharded shapes):
forward ``(cp−1)/cp · (|q| + 2|k| + |out|)``, backward the same for the gradients.
"""
from __future__ import annotations

import torch

from ... import comm
from .blocks import AttentionSpec, LocalAttention, WorkCounter

__all__ = ["SeqToHeads", "HeadsToSeq", "ulysses_attention"]


def _seq_to_heads(x: torch.Tensor, group, cp: int, **tags) -> torch.Tensor:
    """``(..., H, s, D)`` sequence-sharded → ``(..., H/cp, cp·s, D)`` head-sharded."""
    lead, (h, s, d) = x.shape[:-3], x.shape[-3:]
    n = len(lead)
    # head block j goes to rank j: put it first, as all_to_all splits dim 0
    inp = x.reshape(*lead, cp, h // cp, s, d).movedim(n, 0).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group, axis="cp", to="heads", **tags)
    # chunk i came from rank i: its sequence part, which goes to sequence block i
    return out.movedim(0, n + 1).reshape(*lead, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int, **tags) -> torch.Tensor:
    """``(..., h, cp·s, D)`` head-sharded → ``(..., cp·h, s, D)`` sequence-sharded."""
    lead, (h, cps, d) = x.shape[:-3], x.shape[-3:]
    n = len(lead)
    inp = x.reshape(*lead, h, cp, cps // cp, d).movedim(n + 1, 0).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group, axis="cp", to="sequence", **tags)
    return out.movedim(0, n).reshape(*lead, cp * h, cps // cp, d)


class SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all sequence-sharded → head-sharded (``(..., H, s, D)`` →
    ``(..., H/cp, cp·s, D)``). Backward: the inverse all-to-all of the gradient.
    Source: Jacobs et al. 2023, §3.1 (the first all-to-all)."""

    @staticmethod
    def forward(ctx, x, group, cp: int, what: str):
        ctx.group, ctx.cp, ctx.what = group, cp, what
        return _seq_to_heads(x, group, cp, phase="forward", what=what)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(grad, ctx.group, ctx.cp, phase="backward", what="d" + ctx.what),
                None, None, None)


class HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all head-sharded → sequence-sharded (the attention output).
    Backward: the gradient goes head-sharded again. Source: Jacobs et al. 2023, §3.1 (the
    second all-to-all)."""

    @staticmethod
    def forward(ctx, x, group, cp: int, what: str):
        ctx.group, ctx.cp, ctx.what = group, cp, what
        return _heads_to_seq(x, group, cp, phase="forward", what=what)

    @staticmethod
    def backward(ctx, grad):
        return (_seq_to_heads(grad, ctx.group, ctx.cp, phase="backward", what="d" + ctx.what),
                None, None, None)


def ulysses_attention(q, k, v, *, group, cp: int, chunks: tuple, chunk_len: int,
                      causal: bool, counter: WorkCounter):
    """``q`` ``(B, A, S/cp, D)``, ``k``/``v`` ``(B, K, S/cp, D)`` → ``(B, A, S/cp, D)``;
    ``A`` and ``K`` must divide by ``cp``. ``chunks[j]``: global chunk indices of rank ``j``.

    Raises:
        ValueError: ``A`` or ``K`` does not divide by ``cp``.
    """
    a, kh = q.shape[1], k.shape[1]
    if a % cp or kh % cp:
        raise ValueError(f"Ulysses needs the query heads ({a}) and key/value heads ({kh}) on "
                         f"this rank to divide by cp={cp}")
    if cp == 1:
        qh, kvh = q, torch.stack([k, v])
    else:
        qh = SeqToHeads.apply(q, group, cp, "q")
        kvh = SeqToHeads.apply(torch.stack([k, v]), group, cp, "kv")
    order = tuple(cid for j in range(cp) for cid in chunks[j])
    spec = AttentionSpec(order, order, chunk_len, causal, counter, name="cp.ulysses")
    out = LocalAttention.apply(qh, kvh[0], kvh[1], spec)
    return out if cp == 1 else HeadsToSeq.apply(out, group, cp, "out")
