"""A layer's working set: the most bytes of temporaries alive at once inside one block's
forward when nothing is saved for backward — the forward that full recomputation runs
first (Korthikanti et al. 2022 §5; Chen et al. 2016) — on one tensor-parallel rank.

Korthikanti et al. count what a layer *keeps* (:mod:`labkit.plan.activations`); a
checkpointed layer keeps only its input, but while it runs it holds temporaries, and on a
rank whose kept inputs are small beside one layer's full-sequence matmul outputs (sequence
parallelism at large ``T``) the rank's activations peak there, not in the rebuilt layer of
backward. Which temporaries coexist is a matter of the block's code, so
:func:`layer_working_set` replays labkit's block forward as a list of allocations and frees,
one per tensor a line of the code creates or lets go, in the order Python runs them, and
takes the largest live sum. For Llama 3 405B on a TP8 + SP rank (sequence 8,192, microbatch
1, bf16) it is 0.648 GiB, in the MLP's reduce-scatter:

===========================================  ===================  ========================
tensor alive                                 bytes                405B, TP8 + SP
===========================================  ===================  ========================
the attention's residual sum ``h``           ``e·b·(S/T)·H``      32 MiB
the MLP norm's output (the MLP's input)      ``e·b·(S/T)·H``      32 MiB
SwiGLU's gate, up and their product          ``3·e·b·S·F/T``      312 MiB
``w2``'s partial output, full sequence       ``e·b·S·H``          256 MiB
(``b > 1``: its sequence-major copy)         ``e·b·S·H``          —
the reduce-scatter's output                  ``e·b·(S/T)·H``      32 MiB
===========================================  ===================  ========================

(``e`` bytes per activation; ``b`` sequences of ``S`` tokens seen by attention; ``T`` the
tp degree; without SP the shards are whole and the reduce-scatter is an all-reduce into a
fresh ``(b, S, H)``.) The replay covers labkit's three block forms: tensor parallel with SP
(the column inputs all-gathered, :class:`~labkit.parallel.tensor.layers.
_RegatherColumnMatmuls`), tensor parallel without SP (``f``/``g``), and the plain block at
``T = 1`` (:class:`labkit.models.gpt.SwiGLU` frees its gate before computing ``up``). It
assumes the residual stream in the activation dtype (bf16 weights, or fp32; under autocast
over fp32 weights the stream is fp32 and the casts add copies not replayed here), SDPA
attention, a dense SwiGLU MLP, no biases.
"""
from __future__ import annotations

__all__ = ["layer_working_set", "block_forward_events"]


class _Replay:
    def __init__(self):
        self.events: list = []

    def new(self, name: str, nbytes: float) -> str:
        self.events.append(("+", name, nbytes))
        return name

    def free(self, *names: str) -> None:
        for n in names:
            self.events.append(("-", n, 0))


def _norm(r: _Replay, tokens: int, h: int, e: int, tag: str) -> str:
    """labkit.models.norm's forward: ``(x.float()·r).to(x.dtype)·g``; fp32 ``x.float()`` and
    ``.to`` return ``x`` itself."""
    xf = r.new(f"{tag}: x.float()", 4 * tokens * h) if e != 4 else None
    r.new(f"{tag}: x²", 4 * tokens * h)
    r.new(f"{tag}: mean", 4 * tokens)
    r.free(f"{tag}: x²")
    r.new(f"{tag}: +eps", 4 * tokens)
    r.free(f"{tag}: mean")
    r.new(f"{tag}: 1/rms", 4 * tokens)
    r.free(f"{tag}: +eps")
    r.new(f"{tag}: x·r", 4 * tokens * h)
    if e != 4:
        r.new(f"{tag}: cast", e * tokens * h)
        r.free(f"{tag}: x·r")
        out = r.new(tag, e * tokens * h)
        r.free(f"{tag}: cast")
    else:
        out = r.new(tag, e * tokens * h)
        r.free(f"{tag}: x·r")
    if xf:
        r.free(xf)
    r.free(f"{tag}: 1/rms")
    return out


def _rope(r: _Replay, tokens: int, width: int, e: int, tag: str) -> str:
    """labkit.models.gpt.apply_rope on ``width`` features per token: fp32 halves (views in
    fp32), the two rotated halves, their concatenation, the cast back."""
    half = 4 * tokens * width // 2
    if e != 4:
        r.new(f"{tag}: x1", half)
        r.new(f"{tag}: x2", half)
    for side in ("lo", "hi"):
        r.new(f"{tag}: {side} a", half)
        r.new(f"{tag}: {side} b", half)
        r.new(f"{tag}: {side}", half)
        r.free(f"{tag}: {side} a", f"{tag}: {side} b")
    r.new(f"{tag}: cat", 4 * tokens * width)
    r.free(f"{tag}: lo", f"{tag}: hi")
    if e != 4:
        out = r.new(tag, e * tokens * width)
        r.free(f"{tag}: cat", f"{tag}: x1", f"{tag}: x2")
        return out
    r.events.append(("=", tag, f"{tag}: cat"))
    return tag


def block_forward_events(model, b: int, s: int, tp: int = 1, sp: bool = False,
                         act_bytes: int = 2) -> list:
    """labkit's block forward without saving, as ``[("+", name, bytes) | ("-", name, 0) |
    ("=", new name, old name)]`` (allocate, free, rename) on one of ``tp`` ranks, ``b``
    sequences of ``s`` tokens (those attention sees). The block's input is not listed (the
    checkpoint keeps it)."""
    h, d, e = model.d_model, model.head_dim, act_bytes
    a_t, f_t = model.n_heads // tp, model.d_ff // tp
    kv = int(max(model.kv_dim // tp, d))
    sp = sp and tp > 1
    tf = b * s                              # tokens the matmuls see
    tl = tf // tp if sp else tf             # tokens of the residual stream on this rank
    full = e * tf * h
    r = _Replay()

    def gathered(tag: str) -> None:         # gather_seq: the buffer; b > 1 reorders a copy
        r.new(f"{tag}: gathered", full)
        if b > 1:
            r.new(f"{tag}: gathered (seq-major)", full)
            r.free(f"{tag}: gathered")
            r.events.append(("=", f"{tag}: gathered", f"{tag}: gathered (seq-major)"))

    def row_out(tag: str) -> str:           # w_o / w2 then g or the reduce-scatter
        r.new(f"{tag}: partial", full)
        if tp == 1:
            return f"{tag}: partial"
        if sp:
            if b > 1:
                r.new(f"{tag}: rs pieces", full)
            out = r.new(f"{tag}: reduced", e * tl * h)
            if b > 1:
                r.free(f"{tag}: rs pieces")
        else:
            out = r.new(f"{tag}: reduced", full)     # all-reduce into a clone
        r.free(f"{tag}: partial")
        return out

    n1 = _norm(r, tl, h, e, "attn norm")
    # attention
    if tp == 1:                             # gpt.Attention: heads(w(x)) frees each projection
        r.new("q proj", e * tf * a_t * d)
        q = _rope(r, tf, a_t * d, e, "q")
        r.free("q proj")
        r.new("k proj", e * tf * kv)
        k = _rope(r, tf, kv, e, "k")
        r.free("k proj")
        v = r.new("v", e * tf * kv)
    else:
        if sp:
            gathered("attn in")
        r.new("q proj", e * tf * a_t * d)
        r.new("k proj", e * tf * kv)
        v = r.new("v", e * tf * kv)
        if sp:
            r.free("attn in: gathered")
        q = _rope(r, tf, a_t * d, e, "q")
        r.free("q proj")
        k = _rope(r, tf, kv, e, "k")
        r.free("k proj")
    r.new("attention out", e * tf * a_t * d)
    r.new("log-sum-exp", 4 * a_t * tf)
    r.free("log-sum-exp")
    attn = row_out("w_o")
    r.free(q, k, v, "attention out", n1)
    r.new("h", e * tl * h)                  # x + attn(...)
    r.free(attn)
    n2 = _norm(r, tl, h, e, "mlp norm")
    # SwiGLU
    if tp == 1:                             # gpt.SwiGLU: w2(silu(w1(x)) * w3(x))
        r.new("gate", e * tf * f_t)
        r.new("silu", e * tf * f_t)
        r.free("gate")
        r.new("up", e * tf * f_t)
        r.new("product", e * tf * f_t)
        r.free("silu", "up")
        out = row_out("w2")
        r.free("product")
    else:
        if sp:
            gathered("mlp in")
        r.new("gate", e * tf * f_t)
        r.new("up", e * tf * f_t)
        if sp:
            r.free("mlp in: gathered")
        r.new("silu", e * tf * f_t)
        r.new("product", e * tf * f_t)
        r.free("silu")
        out = row_out("w2")
        r.free("product", "gate", "up")
    r.free(n2)
    r.new("block output", e * tl * h)
    r.free(out, "h")
    return r.events


def layer_working_set(model, b: int, s: int, tp: int = 1, sp: bool = False,
                      act_bytes: int = 2) -> dict:
    """The most bytes of temporaries alive at once in one block's forward without saving
    (module docstring), on one of ``tp`` ranks, for ``b`` sequences of ``s`` tokens (the
    tokens attention sees: ``s/cp`` with context parallelism), ``act_bytes`` per activation.

    Args:
        model: a :class:`~labkit.plan.models.PlanModel` (SwiGLU, SDPA attention).

    Returns:
        ``{"bytes": peak, "live": {tensor: bytes} at the peak, "after": the event the peak
        follows}``.

    Raises:
        ValueError: a model labkit's GPT is not (a GELU MLP or eager attention).
    """
    if model.mlp != "swiglu" or model.attention != "flash":
        raise ValueError(f"the working set is replayed for labkit's GPT (SwiGLU, SDPA), got "
                         f"mlp={model.mlp!r}, attention={model.attention!r}")
    live: dict = {}
    peak, at, after = 0, {}, None
    for op, name, n in block_forward_events(model, b, s, tp, sp, act_bytes):
        if op == "+":
            live[name] = n
        elif op == "-":
            live.pop(name)
        else:                               # a rename: the same storage under a new name
            live[name] = live.pop(n)
        total = sum(live.values())
        if total > peak:
            peak, at, after = total, dict(live), name
    return {"bytes": peak, "live": at, "after": after}
