"""A Llama-style decoder with a Switch/GShard/Mixtral mixture of experts, written from the
papers as plain functions over a ``{name: tensor}`` dict, for checking labkit against.

Nothing here comes from ``labkit.models`` or ``labkit.parallel``: a mistake there cannot
reach this file. Parameter names and shapes follow labkit's so its initial weights load by
name (``layers.0.attn.wq.weight`` is ``(A·D, H)``, ``layers.0.mlp.experts.w1`` is
``(E, F, H)``, ``w2`` is ``(E, H, F)``).

* RMSNorm (Zhang & Sennrich 2019, eq. 4), statistic in fp32, ``eps`` from the config.
* Rotary embeddings (Su et al. 2021, RoFormer §3.4.2), frequency ``θ^(−2i/D)``, dimension
  ``i`` paired with ``i + D/2`` (the GPT-NeoX / Hugging Face Llama layout).
* Attention ``softmax(QKᵀ/√D + causal mask)V`` (Vaswani et al. 2017, eq. 1) as explicit
  matmuls, so torch's FLOP counter sees it; grouped-query heads (Ainslie et al. 2023 §2):
  query head ``h`` reads K/V head ``h // (A/K)``.
* SwiGLU ``w2(silu(w1 x) ⊙ w3 x)`` (Shazeer 2020, eq. 6).
* Routing: softmax over ``E`` experts, top-``k``. Top-1 weighs the expert output by the
  router probability itself (Fedus et al. 2022, Switch Transformer §2.1); top-k ≥ 2 weighs
  by the chosen probabilities renormalised to sum to 1 (Jiang et al. 2024, Mixtral §2.1).
* Load balancing per token group ``g`` (Switch §2.2, eq. 4): ``E · Σ_e f_e · P_e``, ``f_e``
  the share of the group's ``T_g·k`` choices that picked ``e`` before dropping, ``P_e``
  the mean router probability of ``e``.
* Capacity (Lepikhin et al. 2020, GShard §2.2): ``ceil(cf · k · T_g / E)`` choices per
  expert and group, filled in order of choice rank first (every first choice before any
  second), token order second; a dropped choice adds nothing.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
import torch.utils.checkpoint


def rms_norm(x, weight, eps):
    """``x`` ``(..., H)`` scaled to unit root-mean-square in fp32, times ``weight``."""
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x, theta):
    """RoPE on ``x`` ``(B, heads, S, D)`` at positions ``0 … S−1``."""
    s, d = x.shape[-2], x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)        # (D/2,)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * freq[None, :]       # (S, D/2)
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., : d // 2].float(), x[..., d // 2:].float()
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)


def attention(x, p, pre, mc, meter):
    """Causal grouped-query self-attention of ``x`` ``(B, S, H)`` → ``(B, S, H)``."""
    b, s, _ = x.shape
    a, kv, d = mc.n_heads, mc.kv_heads, mc.d_model // mc.n_heads
    q = (x @ p[pre + "wq.weight"].t()).view(b, s, a, d).transpose(1, 2)
    k = (x @ p[pre + "wk.weight"].t()).view(b, s, kv, d).transpose(1, 2)
    v = (x @ p[pre + "wv.weight"].t()).view(b, s, kv, d).transpose(1, 2)
    q, k = rotate(q, mc.rope_theta), rotate(k, mc.rope_theta)
    head_of = torch.arange(a) // (a // kv)                   # K/V head each query head reads
    k, v = k[:, head_of], v[:, head_of]
    with meter("attention_core"):
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).float().softmax(-1).to(q.dtype)
        out = probs @ v
    return out.transpose(1, 2).reshape(b, s, a * d) @ p[pre + "wo.weight"].t()


def swiglu(x, w1, w3, w2):
    """``(n, H)`` → ``(n, H)`` with ``w1``/``w3`` ``(F, H)`` and ``w2`` ``(H, F)``."""
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def route_group(logits, k, cf):
    """Routing of one token group: ``logits`` ``(T_g, E)`` → ``(experts (T_g, k), weights
    (T_g, k), keep (T_g, k) bool, aux scalar, counts (E,), kept (E,))``."""
    t, e = logits.shape
    probs = logits.float().softmax(-1)
    top_p, experts = probs.topk(k, dim=-1)
    weights = top_p if k == 1 else top_p / top_p.sum(-1, keepdim=True)
    onehot = F.one_hot(experts, e)                               # (T_g, k, E)
    counts = onehot.sum((0, 1))
    f = counts.float() / (t * k)
    aux = e * (f * probs.mean(0)).sum()
    keep = torch.ones(t, k, dtype=torch.bool)
    if cf is not None:
        cap = math.ceil(cf * k * t / e)
        used = torch.zeros(e, dtype=torch.long)
        for j in range(k):                                       # first choices first
            # this choice's place in its expert's queue: earlier tokens, earlier slots
            place = used[experts[:, j]] + (onehot[:, j].cumsum(0) - onehot[:, j]).gather(
                1, experts[:, j:j + 1]).squeeze(1)
            keep[:, j] = place < cap
            used += onehot[:, j].sum(0)
    kept = (onehot * keep[..., None]).sum((0, 1))
    return experts, weights, keep, aux, counts, kept


def moe(x, p, pre, mc, groups, n_groups, record):
    """Mixture-of-experts MLP of ``x`` ``(B, S, H)`` with token groups ``groups`` ``(B, S)``;
    returns ``(y (B, S, H), Σ_g (T_g/T) aux_g)`` and appends ``(counts, kept)`` ``(G, E)`` to
    ``record``."""
    shape = x.shape
    xf, gid = x.reshape(-1, shape[-1]), groups.reshape(-1)
    logits = xf @ p[pre + "router.weight"].t()
    w1, w3, w2 = (p[pre + "experts." + n] for n in ("w1", "w3", "w2"))
    out = torch.zeros_like(xf)
    aux = xf.new_zeros((), dtype=torch.float32)
    counts, kept = [], []
    for g in range(n_groups):
        tok = (gid == g).nonzero().squeeze(1)                    # token order
        ex, wt, keep, aux_g, c, kc = route_group(logits[tok], mc.top_k, mc.capacity_factor)
        aux = aux + aux_g * len(tok) / len(gid)
        counts.append(c)
        kept.append(kc)
        for e in range(mc.n_experts):
            rows, slot = ((ex == e) & keep).nonzero(as_tuple=True)
            if len(rows):
                y = swiglu(xf[tok[rows]], w1[e], w3[e], w2[e])
                # summed in the residual stream's dtype (fp32 under bf16 autocast)
                out = out.index_add(0, tok[rows], y.to(out.dtype) * wt[rows, slot, None])
    record.append((torch.stack(counts), torch.stack(kept)))
    return out.view(shape), aux


def forward(p, mc, idx, targets, groups, n_groups, meter=None, record=None, segment=None):
    """Objective, LM loss and aux loss for token ids ``idx`` ``(B, S)``.

    Returns ``(objective, lm_loss, aux)``: ``lm_loss`` the mean next-token cross-entropy
    over all ``B·S`` tokens (nats), ``aux`` ``(L,)`` each MoE layer's ``Σ_g (T_g/T) aux_g``
    (empty for a dense model), ``objective = lm_loss + aux_loss_weight · Σ aux``.
    ``meter(name)``: a context manager around each ``"block"`` and ``"attention_core"``
    (FLOP counting); ``record``: list receiving each MoE layer's ``(counts, kept)``;
    ``segment``: blocks per ``torch.utils.checkpoint`` segment (non-reentrant), ``None``
    for none.
    """
    meter = meter or (lambda name: nullcontext())
    record = [] if record is None else record
    x = p["tok_emb.weight"][idx]
    auxes = []

    def block(x, i):
        pre = f"layers.{i}."
        with meter("block"):
            x = x + attention(rms_norm(x, p[pre + "attn_norm.weight"], mc.norm_eps), p,
                              pre + "attn.", mc, meter)
            h = rms_norm(x, p[pre + "mlp_norm.weight"], mc.norm_eps)
            if mc.n_experts:
                y, aux = moe(h, p, pre + "mlp.", mc, groups, n_groups, record)
                auxes.append(aux)
            else:
                y = swiglu(h, *(p[pre + f"mlp.{n}.weight"] for n in ("w1", "w3", "w2")))
            return x + y

    def run(x, first, last):
        for i in range(first, last):
            x = block(x, i)
        return x

    step = segment or mc.n_layers
    for first in range(0, mc.n_layers, step):
        last = min(first + step, mc.n_layers)
        if segment:
            x = torch.utils.checkpoint.checkpoint(run, x, first, last, use_reentrant=False)
        else:
            x = run(x, first, last)
    logits = rms_norm(x, p["norm.weight"], mc.norm_eps) @ p["head.weight"].t()
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    aux = torch.stack(auxes) if auxes else lm.new_zeros(0)
    return lm + mc.aux_loss_weight * aux.sum(), lm, aux
