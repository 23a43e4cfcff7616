"""Ring attention: queries stay, K/V blocks travel around the context-parallel ring.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context", §3 and Algorithm 1: each of ``cp`` ranks keeps its queries; its K/V block is sent
to the next rank while the block it holds is attended, so after ``cp`` steps every query has
seen every key and each send/recv ran under a block's computation. Partial results merge by
the online-softmax log-sum-exp rule (:func:`.blocks.merge`).

Forward, rank ``r``, step ``s = 0 … cp−1``: it holds the K/V that rank ``r−s`` started with;
it posts the send of that block to ``r+1`` and the receive of the next from ``r−1``
*before* computing, computes its blocks (causal: full, diagonal or skipped by global chunk
index), then waits. ``cp−1`` K/V hops.

Backward (the ring again, as in the paper's released code and ``ring-flash-attention``): K/V
travel the same way and with them an accumulator of their gradient. At step ``s`` rank ``r``
computes the blocks of the K/V from rank ``r−s`` with the **merged** output and the
**global** log-sum-exp saved by the forward, adds its ``dQ`` locally and its ``dK``/``dV`` to
the accumulator that arrived from ``r−1``, and sends the accumulator on; the ``cp``-th hop
delivers each rank's finished ``dK``/``dV`` home. ``cp−1`` K/V hops plus ``cp`` gradient
hops; the gradient hop of step ``s`` is waited for only after step ``s+1``'s computation.
Nothing here is differentiated by autograd: :class:`RingAttention` writes both passes.

Every message goes through :func:`labkit.comm.batch_isend_irecv` (axis ``"cp"``, tags
``phase``, ``ring_step``, ``what`` = ``"kv"``/``"dkv"``); every step's computation is one
traced region ``cp.ring.forward`` / ``cp.ring.backward`` whose args name the K/V block held
(``kv_origin``) and the blocks computed — what the animation replays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import comm
from ...trace import current_tracer, use_tracer
from .blocks import (WorkCounter, backward_blocks, forward_blocks, group_heads, output_like,
                     plan_blocks)

__all__ = ["RingSpec", "RingAttention", "TAG_KV", "TAG_DKV"]

#: message tags: K/V blocks and their gradient accumulators never match each other's receives
TAG_KV, TAG_DKV = 11, 12


@dataclass
class RingSpec:
    """The ring: ``group`` (its global ``ranks`` in group order), this rank's index
    ``rank`` of ``cp``, the global chunk indices every rank holds (``chunks[j]``), the chunk
    length, the mask, the counter."""

    group: object
    ranks: tuple
    rank: int
    cp: int
    chunks: tuple
    chunk_len: int
    causal: bool
    counter: WorkCounter

    @property
    def next(self) -> int:
        return self.ranks[(self.rank + 1) % self.cp]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.cp]


def _exchange(spec: RingSpec, send: torch.Tensor, phase: str, step: int, what: str):
    """Post send-to-next and receive-from-previous; returns ``(buffer, handles)``."""
    buf = torch.empty_like(send)
    handles = comm.batch_isend_irecv([(send, spec.next)], [(buf, spec.prev)], spec.group,
                                     axis="cp", tag=TAG_KV if what == "kv" else TAG_DKV,
                                     phase=phase, ring_step=step, what=what)
    return buf, handles


def _wait(handles) -> None:
    for h in handles:
        h.wait()


class RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (Liu et al. 2023, §3, Algorithm 1).

    ``q`` ``(B, A, S/cp, D)``, ``k``/``v`` ``(B, K, S/cp, D)`` holding this rank's chunks
    (``spec.chunks[spec.rank]``); returns ``(B, A, S/cp, D)``. Forward: send/recv of K/V
    (``cp−1`` hops of ``2·|k|`` bytes); backward: K/V (``cp−1`` hops) and ``dK``/``dV``
    (``cp`` hops, same size).
    """

    @staticmethod
    def forward(ctx, q, k, v, spec: RingSpec):
        r, cp, c = spec.rank, spec.cp, spec.chunk_len
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = group_heads(q.float(), k.shape[1])
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=qg.dtype, device=qg.device)
        kv = torch.stack([k, v])  # one message per hop
        for s in range(cp):
            src = (r - s) % cp
            nxt, handles = _exchange(spec, kv, "forward", s, "kv") if s < cp - 1 else (None, [])
            spec.counter.hold("forward", *(t for t in (kv, nxt) if t is not None))
            blocks = plan_blocks(spec.chunks[r], spec.chunks[src], spec.causal)
            forward_blocks(qg, kv[0].float(), kv[1].float(), blocks, c, scale, out, lse,
                           spec.counter, name="cp.ring", ring_step=s, kv_origin=src)
            _wait(handles)
            kv = nxt if nxt is not None else kv
        out = output_like(q, out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.scale, ctx.tracer = spec, scale, current_tracer()
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, scale = ctx.spec, ctx.scale
        with use_tracer(current_tracer() or ctx.tracer):  # CUDA runs backward on its own thread
            dq, dk, dv = _ring_backward(spec, scale, q, k, v, out, lse, dout)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _ring_backward(spec: RingSpec, scale, q, k, v, out, lse, dout):
    """``(dq (B, K, G, S/cp, D), dk, dv)`` in fp32: this rank's query gradient and its own
    K/V gradients, home after ``cp`` hops."""
    r, cp, c, n_kv = spec.rank, spec.cp, spec.chunk_len, k.shape[1]
    qg, dog = group_heads(q.float(), n_kv), group_heads(dout.float(), n_kv)
    delta = (dog * group_heads(out.float(), n_kv)).sum(-1)
    dq = torch.zeros_like(qg)
    kv = torch.stack([k, v])
    acc, acc_in, grad_handles = None, None, []
    for s in range(cp):
        src = (r - s) % cp
        nxt, handles = _exchange(spec, kv, "backward", s, "kv") if s < cp - 1 else (None, [])
        part = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        blocks = plan_blocks(spec.chunks[r], spec.chunks[src], spec.causal)
        backward_blocks(qg, kv[0].float(), kv[1].float(), dog, lse, delta, blocks, c, scale,
                        dq, part[0], part[1], spec.counter, name="cp.ring", ring_step=s,
                        kv_origin=src)
        if s > 0:  # the accumulator of rank r−s's K/V, from r−1, arrived under the compute
            _wait(grad_handles)
            part += acc_in
        acc = part
        if cp > 1:
            acc_in, grad_handles = _exchange(spec, acc, "backward", s, "dkv")
        spec.counter.hold("backward", *(t for t in (kv, nxt, acc, acc_in) if t is not None))
        _wait(handles)
        kv = nxt if nxt is not None else kv
    if cp > 1:  # the cp-th hop: this rank's own K/V gradient, summed over every rank's queries
        _wait(grad_handles)
        acc = acc_in
    return dq, acc[0], acc[1]
