"""Routing for the mixture-of-experts layer: which experts each token goes to, with what
weight, which choices a capacity drops, and the load-balancing loss, per token group.

* Router probabilities (Shazeer et al. 2017, §2.1): a softmax over the ``E`` experts in
  fp32 and its ``top_k`` largest.
* Combine weights: with ``top_k = 1`` the expert output is scaled by the router probability
  ``p`` itself (Switch Transformer, Fedus et al. 2022, §2.1: ``y = p_i(x) E_i(x)``), which
  is how the language-model loss reaches the router; renormalising one probability would
  make it 1.0 and cut that path. With ``top_k ≥ 2`` the chosen probabilities are
  renormalised to sum to 1 (Mixtral, Jiang et al. 2024, §2.1: softmax over the top-k
  logits, which is the same thing). Capacity-limited top-1 keeps the ``p`` weight.
* Load-balancing loss per group ``g`` (Switch §2.2, eq. 4; GShard, Lepikhin et al. 2020,
  §2.2): ``aux_g = E · Σ_e f_e · P_e``, ``f_e`` the fraction of the group's ``T_g · k``
  choices that picked ``e`` (before any dropping), ``P_e`` the mean probability of ``e`` over
  the group's tokens; 1 when balanced. A forward's value is ``Σ_g (T_g / T) · aux_g``.
* Capacity (GShard §2.2; Switch §2.2): a group may send at most
  ``C_g = ceil(capacity_factor · k · T_g / E)`` choices to one expert, in GShard's order:
  every first choice before any second choice, and within a choice, token order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["Routing", "RoutingStats", "route", "capacity", "token_group_ids", "TokenGroups"]

TokenGroups = Union[None, int, torch.Tensor]


def capacity(tokens: int, n_experts: int, top_k: int,
             capacity_factor: Optional[float]) -> Optional[int]:
    """Choices one expert may take from a group of ``tokens``: ``ceil(cf · k · T / E)``,
    or ``None`` without a capacity factor (GShard §2.2; Switch Transformer §2.2)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


@dataclass
class RoutingStats:
    """What one forward of one MoE layer routed (detached; plain tensors, CPU-cheap).

    Attributes:
        layer: the layer index in the GPT (``None`` for a bare layer).
        tokens: ``(G,)`` int64 tokens per group.
        counts: ``(G, E)`` int64 choices per group and expert before dropping.
        kept: ``(G, E)`` int64 choices that were processed (``counts`` minus drops).
        dropped: ``(n, 2)`` int64 ``(token, slot)`` of every dropped choice; ``token`` is the
            index in this forward's flattened ``(B·S)`` tokens.
        aux: scalar, the layer's aux loss ``Σ_g (T_g/T) aux_g`` (without the weight).
        aux_per_group: ``(G,)`` ``aux_g``.
    """

    layer: Optional[int]
    tokens: torch.Tensor
    counts: torch.Tensor
    kept: torch.Tensor
    dropped: torch.Tensor
    aux: torch.Tensor
    aux_per_group: torch.Tensor


@dataclass
class Routing:
    """One forward's routing decision over ``T`` tokens and ``G`` groups.

    ``probs`` ``(T, E)`` fp32 softmax; ``experts`` ``(T, k)`` int64 chosen experts (largest
    probability first); ``weights`` ``(T, k)`` fp32, the combine weights: the chosen
    probability itself for ``k = 1`` (Switch §2.1; below 1), the chosen probabilities
    renormalised to sum to 1 for ``k ≥ 2`` (Mixtral §2.1); ``keep`` ``(T, k)`` bool, False for a choice dropped by the capacity;
    ``groups`` ``(T,)`` int64 group of each token; ``aux`` the differentiable aux loss;
    ``stats`` the detached record.
    """

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    groups: torch.Tensor
    aux: torch.Tensor
    stats: RoutingStats


def route(logits: torch.Tensor, top_k: int, capacity_factor: Optional[float],
          groups: torch.Tensor, n_groups: int, layer: Optional[int] = None) -> Routing:
    """Softmax, top-k, combine weights, aux loss and capacity for router ``logits`` ``(T, E)``.

    ``groups`` ``(T,)`` int64 in ``[0, n_groups)``: the token group of each row. The
    weights are ``p`` for ``top_k = 1`` (Switch §2.1) and renormalised over the chosen
    ``top_k ≥ 2`` (Mixtral §2.1); see :class:`Routing`.
    """
    t, e = logits.shape
    probs = logits.float().softmax(dim=-1)
    top_p, experts = probs.topk(top_k, dim=-1)
    # top-1 keeps p so the token loss has a path to the router (Switch §2.1); k >= 2
    # renormalises, the relative sizes of the chosen p carrying that path (Mixtral §2.1)
    weights = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)
    tokens = torch.bincount(groups, minlength=n_groups)
    key = groups[:, None] * e + experts                       # (T, k): (group, expert)
    counts = torch.bincount(key.reshape(-1), minlength=n_groups * e).view(n_groups, e)
    tg = tokens.clamp(min=1).to(probs.dtype)[:, None]
    frac_chosen = counts.to(probs.dtype) / (tg * top_k)        # f_e, not differentiable
    mean_prob = probs.new_zeros(n_groups, e).index_add(0, groups, probs) / tg    # P_e
    aux_g = e * (frac_chosen * mean_prob).sum(dim=-1)
    aux = (aux_g * tokens.to(probs.dtype)).sum() / max(t, 1)
    keep = _capacity_keep(key, tokens, e, top_k, capacity_factor)
    kept = torch.bincount(key[keep], minlength=n_groups * e).view(n_groups, e)
    stats = RoutingStats(layer, tokens, counts, kept, (~keep).nonzero(), aux.detach(),
                         aux_g.detach())
    return Routing(probs, experts, weights, keep, groups, aux, stats)


def _capacity_keep(key: torch.Tensor, tokens: torch.Tensor, n_experts: int, top_k: int,
                   capacity_factor: Optional[float]) -> torch.Tensor:
    """``(T, k)`` bool: the choices within their (group, expert)'s capacity, GShard order."""
    if capacity_factor is None:
        return torch.ones_like(key, dtype=torch.bool)
    caps = torch.tensor([capacity(n, n_experts, top_k, capacity_factor) for n in tokens.tolist()],
                        dtype=torch.long, device=key.device)
    flat = key.t().reshape(-1)             # slot-major: all first choices, then second ...
    order = torch.argsort(flat, stable=True)
    seg = torch.bincount(flat, minlength=len(tokens) * n_experts)
    starts = seg.cumsum(0) - seg
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(len(flat), device=key.device) - starts[flat[order]]
    keep = pos < caps.repeat_interleave(n_experts)[flat]
    return keep.view(top_k, -1).t()


def token_group_ids(spec: TokenGroups, lead_shape: tuple, device) -> tuple:
    """``(groups (T,) int64, G)`` for a forward of ``lead_shape = (B, S)`` tokens.

    ``spec``: ``None`` → one group; an int ``n`` → the batch split into ``n`` equal runs of
    rows (data ranks in order); an int64 tensor of ``lead_shape`` (or ``(T,)``) → the group
    id of each token, ``0 … G−1``.

    Raises:
        ValueError: ``n`` not dividing ``B``, or a tensor of the wrong shape.
    """
    t = math.prod(lead_shape)
    if spec is None:
        return torch.zeros(t, dtype=torch.long, device=device), 1
    if isinstance(spec, int):
        b = lead_shape[0]
        if spec < 1 or b % spec:
            raise ValueError(f"token_groups={spec} must divide the batch of {b} rows")
        rows = torch.arange(b, device=device) // (b // spec)
        return rows.repeat_interleave(t // b), spec
    ids = spec.to(device=device, dtype=torch.long).reshape(-1)
    if ids.numel() != t:
        raise ValueError(f"token_groups has {ids.numel()} entries, the forward {t} tokens "
                         f"(shape {tuple(lead_shape)})")
    return ids, int(ids.max().item()) + 1 if t else 1
