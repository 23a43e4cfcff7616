"""Blockwise attention with an explicit log-sum-exp: the math every context-parallel method runs.

A sequence chunk of queries against a chunk of keys is one **block**. With causal masking a
block is *full* (the query chunk comes after the key chunk), *diagonal* (the same chunk:
lower-triangular mask) or *skipped* (the query chunk comes first: everything masked, so it
is never computed). A block returns its partial output and the log-sum-exp of its scores,
and partial results merge exactly by the online-softmax rule (Milakov & Gimelshein 2018;
Dao et al. 2022, FlashAttention §3.1; Liu et al. 2023, Ring Attention §3)::

    lse = log(e^lse₁ + e^lse₂),   out = e^(lse₁−lse)·out₁ + e^(lse₂−lse)·out₂

The backward of a block needs only the *merged* output ``O`` and the *global* ``lse``:
``P = exp(QKᵀ·scale − lse)``, ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``,
``dQ = dS K·scale``, ``dK = dSᵀ Q·scale`` (FlashAttention §3.1, Appendix B.2), so each block's
gradient is computed independently, wherever its K/V happen to be.

Grouped-query attention (Ainslie et al. 2023) without repeating K/V: queries are viewed as
``(B, K, G, S, D)`` with ``G = A/K`` heads per K/V head, the grouping
``repeat_interleave`` gives, and ``dK``/``dV`` sum over the group.

:class:`LocalAttention` is the autograd Function over one rank's queries and the K/V chunks
it holds (all-gather and Ulysses use it; it is also the single-rank reference). Every block
is counted in a :class:`WorkCounter` and traced as part of a compute region.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...trace import current_tracer, region, use_tracer

__all__ = ["FULL", "DIAGONAL", "SKIPPED", "block_kind", "plan_blocks", "unmasked_pairs",
           "block_forward", "block_backward", "merge", "WorkCounter", "LocalAttention",
           "AttentionSpec", "forward_blocks", "backward_blocks", "group_heads", "output_like"]

FULL, DIAGONAL, SKIPPED = "full", "diagonal", "skipped"


def block_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """``"full"``, ``"diagonal"`` or ``"skipped"`` for global chunk indices."""
    if not causal or q_chunk > kv_chunk:
        return FULL
    return DIAGONAL if q_chunk == kv_chunk else SKIPPED


def plan_blocks(q_chunks, kv_chunks, causal: bool) -> list:
    """Every (query chunk, K/V chunk) block: ``(qi, kj, q_chunk, kv_chunk, kind)`` with
    ``qi``/``kj`` the positions in the local tensors and the chunks' global indices."""
    return [(qi, kj, qc, kc, block_kind(qc, kc, causal))
            for qi, qc in enumerate(q_chunks) for kj, kc in enumerate(kv_chunks)]


def unmasked_pairs(kind: str, c: int) -> int:
    """Query–key pairs a block of ``c × c`` leaves unmasked."""
    return {FULL: c * c, DIAGONAL: c * (c + 1) // 2, SKIPPED: 0}[kind]


def group_heads(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """``(B, A, S, D)`` → ``(B, K, A/K, S, D)``: query head ``a`` uses K/V head ``a // G``."""
    b, a, s, d = q.shape
    return q.reshape(b, n_kv, a // n_kv, s, d)


def output_like(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The merged output ``out`` (any layout, ``q``'s element count) as a tensor of ``q``'s
    shape, dtype and memory layout: the attention module hands its query in as a transposed
    ``(B, S, A, D)`` tensor (:func:`labkit.models.gpt.heads`), so the output projection
    then reads the output this Function keeps for backward as a view instead of keeping a
    copy of its own, as after PyTorch's SDPA."""
    res = torch.empty_like(q)  # preserve_format: q's strides
    return res.copy_(out.reshape(q.shape))


def _scores(q, k, kind: str, scale: float) -> torch.Tensor:
    s = torch.einsum("bkgqd,bksd->bkgqs", q, k) * scale
    if kind == DIAGONAL:
        n = s.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_forward(q, k, v, kind: str, scale: float) -> tuple:
    """One block: ``q`` ``(B, K, G, c, D)``, ``k``/``v`` ``(B, K, c, D)`` (fp32) →
    ``(out (B, K, G, c, D), lse (B, K, G, c))``."""
    s = _scores(q, k, kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("bkgqs,bksd->bkgqd", p, v), lse


def block_backward(q, k, v, dout, lse, delta, kind: str, scale: float) -> tuple:
    """Gradients of one block from the merged output's ``dout`` ``(B, K, G, c, D)``, the
    global ``lse`` and ``delta = rowsum(dout ∘ out)`` (both ``(B, K, G, c)``) →
    ``(dq (B, K, G, c, D), dk (B, K, c, D), dv (B, K, c, D))``."""
    p = torch.exp(_scores(q, k, kind, scale) - lse.unsqueeze(-1))
    dv = torch.einsum("bkgqs,bkgqd->bksd", p, dout)
    dp = torch.einsum("bkgqd,bksd->bkgqs", dout, v)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.einsum("bkgqs,bksd->bkgqd", ds, k) * scale
    dk = torch.einsum("bkgqs,bkgqd->bksd", ds, q) * scale
    return dq, dk, dv


def merge(out, lse, out_b, lse_b) -> tuple:
    """Online-softmax merge of a running ``(out, lse)`` with a block's ``(out_b, lse_b)``.
    A running ``lse`` of ``-inf`` (nothing seen yet) takes the block as it is."""
    new = torch.logaddexp(lse, lse_b)
    out = out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
    return out, new


@dataclass
class WorkCounter:
    """A rank's own count of the attention work it did.

    Attributes:
        pairs: unmasked query–key pairs computed, times batch rows and query heads, by
            phase (``"forward"``, ``"backward"``).
        blocks: blocks by ``(phase, kind)``, skipped ones included.
        kv_bytes: by phase, the most bytes of K/V (and, in backward, of K/V gradients)
            buffers one attention call held at once: the method's K/V working set.
    """

    pairs: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)
    kv_bytes: dict = field(default_factory=dict)

    def add(self, phase: str, kind: str, pairs: int) -> None:
        self.pairs[phase] = self.pairs.get(phase, 0) + pairs
        self.blocks[(phase, kind)] = self.blocks.get((phase, kind), 0) + 1

    def hold(self, phase: str, *tensors) -> None:
        """Note that the K/V buffers ``tensors`` are alive together now."""
        held = sum(t.numel() * t.element_size() for t in tensors)
        self.kv_bytes[phase] = max(self.kv_bytes.get(phase, 0), held)

    def reset(self) -> None:
        self.pairs, self.blocks, self.kv_bytes = {}, {}, {}

    def to_dict(self) -> dict:
        """Plain data: ``{"pairs": {phase: n}, "blocks": {"forward/full": n, ...},
        "kv_bytes": {phase: n}}``."""
        return {"pairs": dict(self.pairs), "kv_bytes": dict(self.kv_bytes),
                "blocks": {f"{ph}/{k}": n for (ph, k), n in self.blocks.items()}}


def forward_blocks(q, k, v, blocks, c: int, scale: float, out, lse, counter, **trace):
    """Compute ``blocks`` (from :func:`plan_blocks`) of grouped ``q`` against ``k``/``v``,
    merging into ``out``/``lse`` in place; one traced compute region for all of them."""
    heads = q.shape[0] * q.shape[1] * q.shape[2]
    work = [(qc, kc, kind, heads * unmasked_pairs(kind, c)) for _qi, _kj, qc, kc, kind in blocks]
    with region(trace.pop("name") + ".forward", blocks=work,
                pairs=sum(w[3] for w in work), **trace):
        for (qi, kj, _qc, _kc, kind), (*_, n) in zip(blocks, work):
            counter.add("forward", kind, n)
            if kind == SKIPPED:
                continue
            qs, ks = slice(qi * c, (qi + 1) * c), slice(kj * c, (kj + 1) * c)
            o_b, l_b = block_forward(q[..., qs, :], k[..., ks, :], v[..., ks, :], kind, scale)
            out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o_b, l_b)


def backward_blocks(q, k, v, dout, lse, delta, blocks, c: int, scale: float, dq, dk, dv,
                    counter, **trace):
    """Accumulate the gradients of ``blocks`` into ``dq`` (grouped) and ``dk``/``dv``."""
    heads = q.shape[0] * q.shape[1] * q.shape[2]
    work = [(qc, kc, kind, heads * unmasked_pairs(kind, c)) for _qi, _kj, qc, kc, kind in blocks]
    with region(trace.pop("name") + ".backward", blocks=work,
                pairs=sum(w[3] for w in work), **trace):
        for (qi, kj, _qc, _kc, kind), (*_, n) in zip(blocks, work):
            counter.add("backward", kind, n)
            if kind == SKIPPED:
                continue
            qs, ks = slice(qi * c, (qi + 1) * c), slice(kj * c, (kj + 1) * c)
            g = block_backward(q[..., qs, :], k[..., ks, :], v[..., ks, :], dout[..., qs, :],
                               lse[..., qs], delta[..., qs], kind, scale)
            dq[..., qs, :] += g[0]
            dk[..., ks, :] += g[1]
            dv[..., ks, :] += g[2]


@dataclass
class AttentionSpec:
    """What :class:`LocalAttention` needs besides tensors: the global chunk index of each
    chunk of the local queries and K/V, the chunk length, the mask, the counter, and the
    trace name of its regions (e.g. ``"cp.allgather"``) plus extra region args."""

    q_chunks: tuple
    kv_chunks: tuple
    chunk_len: int
    causal: bool
    counter: WorkCounter
    name: str = "attention"
    trace: dict = field(default_factory=dict)


class LocalAttention(torch.autograd.Function):
    """``softmax(QKᵀ/√D + mask)V`` over the K/V chunks this rank holds, block by block with an
    explicit log-sum-exp, forward and backward written out (FlashAttention §3.1, App. B.2).

    ``q`` ``(B, A, Sq, D)``, ``k``/``v`` ``(B, K, Skv, D)`` whose sequence dims hold the
    chunks ``spec.q_chunks`` / ``spec.kv_chunks`` (global indices) of ``spec.chunk_len``
    tokens each; returns ``(B, A, Sq, D)``. Saves ``q, k, v, out`` and the ``lse``.
    """

    @staticmethod
    def forward(ctx, q, k, v, spec: AttentionSpec):
        n_kv, c = k.shape[1], spec.chunk_len
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = group_heads(q.float(), n_kv)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=qg.dtype, device=qg.device)
        blocks = plan_blocks(spec.q_chunks, spec.kv_chunks, spec.causal)
        spec.counter.hold("forward", k, v)
        forward_blocks(qg, k.float(), v.float(), blocks, c, scale, out, lse, spec.counter,
                       name=spec.name, **spec.trace)
        out = output_like(q, out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.blocks, ctx.scale, ctx.tracer = spec, blocks, scale, current_tracer()
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, n_kv = ctx.spec, k.shape[1]
        with use_tracer(current_tracer() or ctx.tracer):  # CUDA runs backward on its own thread
            qg, dog = group_heads(q.float(), n_kv), group_heads(dout.float(), n_kv)
            delta = (dog * group_heads(out.float(), n_kv)).sum(-1)
            dq = torch.zeros_like(qg)
            dk, dv = torch.zeros_like(k, dtype=qg.dtype), torch.zeros_like(v, dtype=qg.dtype)
            spec.counter.hold("backward", k, v, dk, dv)
            backward_blocks(qg, k.float(), v.float(), dog, lse, delta, ctx.blocks,
                            spec.chunk_len, ctx.scale, dq, dk, dv, spec.counter,
                            name=spec.name, **spec.trace)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
