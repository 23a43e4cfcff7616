"""Mixture-of-experts feed-forward: a router and ``E`` SwiGLU experts (the dense reference).

* Router (Shazeer et al. 2017, §2.1; Fedus et al. 2022, Switch Transformer §2.1): a bias-free
  linear map ``H → E``, a softmax over the experts in fp32, the ``top_k`` largest
  probabilities, renormalised so the chosen ``k`` weights of a token sum to 1.
* Experts: ``E`` SwiGLU MLPs (Shazeer 2020, eq. 6) with stacked weights ``w1``/``w3``
  ``(E, F, H)`` and ``w2`` ``(E, H, F)``: expert ``e`` is ``SwiGLU`` with ``w1.weight =
  w1[e]``. Expert parallelism keeps a slice ``[first, first + n_local)`` of them per rank.
* Load-balancing loss per token group ``g`` (Switch §2.2, eq. 4; GShard, Lepikhin et al. 2020,
  §2.2): ``aux_g = E · Σ_e f_e · P_e`` with ``f_e`` the fraction of the group's ``T_g · k``
  choices that picked ``e`` (before any dropping) and ``P_e`` the mean router probability of
  ``e`` over the group's tokens; 1 when perfectly balanced. The layer's value is the
  token-weighted mean over its groups, ``Σ_g (T_g / T) · aux_g``.
* Capacity (GShard §2.2, Switch §2.2): with a ``capacity_factor`` each group may send at most
  ``C_g = ceil(capacity_factor · k · T_g / E)`` choices to one expert. Priority is GShard's:
  every token's first choice before any second choice, and within a choice, token order in
  the group. A dropped choice adds nothing; a token with all choices dropped leaves the block
  as its residual.

Token groups. The aux loss and the capacity are nonlinear in the set of tokens, so they are
defined per *group*: one microbatch on one data rank. ``MoE.token_groups`` tells the
single-process reference where the groups are in its (global) batch, so it computes the
same numbers as the ranks do (see :func:`set_token_groups`).

The aux loss enters backward through :class:`AuxLossAutoScaler`, which rides on the layer's
output, so it works inside any pipeline stage without being added to the returned loss.
``aux_loss_weight · aux_scale`` is its factor in the objective; the training job sets
``aux_scale`` to this forward's share of the global batch (:func:`set_aux_loss_scale`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "Experts", "Routing", "RoutingStats", "route", "capacity", "dense_experts",
           "AuxLossAutoScaler", "moe_layers", "set_token_groups", "set_aux_loss_scale",
           "aux_loss", "record_routing", "token_group_ids"]

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
    probability first); ``weights`` ``(T, k)`` fp32, the chosen probabilities renormalised to
    sum to 1; ``keep`` ``(T, k)`` bool, False for a choice dropped by the capacity;
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
    """Softmax, top-k, renormalisation, aux loss and capacity for router ``logits`` ``(T, E)``.

    ``groups`` ``(T,)`` int64 in ``[0, n_groups)``: the token group of each row.
    """
    t, e = logits.shape
    probs = logits.float().softmax(dim=-1)
    top_p, experts = probs.topk(top_k, dim=-1)
    weights = top_p / top_p.sum(dim=-1, keepdim=True)
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


class AuxLossAutoScaler(torch.autograd.Function):
    """Forward: the layer output unchanged. Backward: the output's gradient unchanged, and
    ``scale`` as the gradient of the aux loss, so ``scale · aux`` joins the objective.

    The aux loss need not be returned through the pipeline to the loss: its gradient starts
    where the layer's output gradient arrives (Megatron-Core's ``MoEAuxLossAutoScaler``;
    the loss is Switch Transformer's eq. 4, Fedus et al. 2022 §2.2).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class Experts(nn.Module):
    """``n_local`` SwiGLU experts with stacked weights, global ids ``first … first+n_local−1``.

    ``w1`` (gate), ``w3`` (up): ``(n_local, F, H)``; ``w2`` (down): ``(n_local, H, F)``.
    """

    def __init__(self, n_experts: int, d_model: int, ffn_dim: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.n_experts, self.first = n_experts, 0
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model, **kw))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, d_model, **kw))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, ffn_dim, **kw))

    @property
    def n_local(self) -> int:
        return self.w1.shape[0]

    def reset_parameters(self, std: float) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, 0.0, std)

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``i`` on ``x`` ``(n, H)`` → ``(n, H)`` (``n`` may be 0)."""
        return F.linear(F.silu(F.linear(x, self.w1[i])) * F.linear(x, self.w3[i]), self.w2[i])


def dense_experts(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    """The single-process combine: ``Σ_k weights[t, k] · expert_{experts[t, k]}(x[t])`` over
    the kept choices; ``x`` ``(T, H)`` → ``(T, H)``. Every expert runs (on zero rows when it
    has no tokens), so every expert weight gets a gradient, zero or not.

    Raises:
        ValueError: ``experts`` holds a slice only (expert parallelism needs its dispatcher).
    """
    if experts.n_local != routing.probs.shape[1]:
        raise ValueError(f"the dense MoE path needs all {routing.probs.shape[1]} experts, this "
                         f"rank holds {experts.n_local}: set MoE.dispatcher (expert parallelism)")
    out = torch.zeros_like(x)
    for e in range(experts.n_local):
        tok, slot = ((routing.experts == e) & routing.keep).nonzero(as_tuple=True)
        y = experts.expert(e, x[tok])
        out = out.index_add(0, tok, y * routing.weights[tok, slot, None].to(y.dtype))
    return out


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


class MoE(nn.Module):
    """Router + experts in place of a block's MLP; ``(B, S, H)`` in/out.

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``.
        experts: :class:`Experts`.
        dispatcher: ``None`` (dense path, :func:`dense_experts`) or a callable
            ``dispatcher(x (T, H), routing, experts, layer=...) -> (T, H)``, set by expert
            parallelism.
        token_groups, aux_scale: see :func:`set_token_groups`, :func:`set_aux_loss_scale`.
        last_stats: the :class:`RoutingStats` of the last forward.
    """

    def __init__(self, cfg, device=None, dtype=None):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor, self.aux_loss_weight = cfg.capacity_factor, cfg.aux_loss_weight
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False, device=device,
                                dtype=dtype)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.ffn_dim, device, dtype)
        self.dispatcher = None
        self.token_groups: TokenGroups = None
        self.aux_scale = 1.0
        self.layer_id: Optional[int] = None
        self.last_stats: Optional[RoutingStats] = None
        self._log: Optional[list] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        groups, n_groups = token_group_ids(self.token_groups, tuple(shape[:-1]), x.device)
        routing = route(self.router(xf), self.top_k, self.capacity_factor, groups, n_groups,
                        self.layer_id)
        if self.dispatcher is None:
            y = dense_experts(xf, routing, self.experts)
        else:
            y = self.dispatcher(xf, routing, self.experts, layer=self.layer_id)
        self.last_stats = routing.stats
        if self._log is not None:
            self._log.append(routing.stats)
        y = y.view(shape)
        scale = self.aux_loss_weight * self.aux_scale
        if scale and torch.is_grad_enabled() and routing.aux.requires_grad:
            y = AuxLossAutoScaler.apply(y, routing.aux, scale)
        return y


def moe_layers(module: nn.Module) -> list:
    """The :class:`MoE` layers inside ``module`` (a GPT, a pipeline stage or one layer)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_token_groups(module: nn.Module, groups: TokenGroups) -> None:
    """Where the token groups are in the batch each MoE layer of ``module`` sees (see
    :func:`token_group_ids`). A rank running one microbatch leaves ``None``; the
    single-process reference of ``n`` data ranks passes ``n``."""
    for m in moe_layers(module):
        m.token_groups = groups


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Factor of each forward's aux loss in the objective, on top of ``aux_loss_weight``:
    the forward's tokens over the global batch's under the one loss rule (sum over tokens
    divided by the global token count); 1 for a single process on the whole batch."""
    for m in moe_layers(module):
        m.aux_scale = float(scale)


def aux_loss(module: nn.Module, weighted: bool = False) -> float:
    """Sum over the MoE layers of their last forward's aux loss (times ``aux_loss_weight``
    when ``weighted``); 0.0 without MoE layers or before a forward."""
    total = 0.0
    for m in moe_layers(module):
        if m.last_stats is not None:
            total += float(m.last_stats.aux) * (m.aux_loss_weight if weighted else 1.0)
    return total


@contextmanager
def record_routing(module: nn.Module) -> Iterator[list]:
    """Collect the :class:`RoutingStats` of every MoE forward inside the ``with`` body,
    in the order they ran (layers, then microbatches)."""
    log: list = []
    layers = moe_layers(module)
    for m in layers:
        m._log = log
    try:
        yield log
    finally:
        for m in layers:
            m._log = None
