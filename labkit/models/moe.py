"""Mixture-of-experts feed-forward: a router and ``E`` SwiGLU experts (the dense reference).

* Router: a bias-free linear map ``H → E``; the routing itself (softmax, top-k, the
  combine weights: ``p`` for top-1, renormalised for top-k ≥ 2; the Switch/GShard
  load-balancing loss, capacity and GShard's drop order) is :mod:`labkit.models.router`.
* Experts: ``E`` SwiGLU MLPs (Shazeer 2020, eq. 6) with stacked weights ``w1``/``w3``
  ``(E, F, H)`` and ``w2`` ``(E, H, F)``: expert ``e`` is ``SwiGLU`` with ``w1.weight =
  w1[e]``. Expert parallelism keeps a slice ``[first, first + n_local)`` of them per rank.
* Output: the router-weighted sum of a token's kept expert outputs; a choice dropped by the
  capacity adds nothing, so a token with all choices dropped leaves the block as its
  residual.

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

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .router import (Routing, RoutingStats, TokenGroups, capacity, route,  # noqa: F401
                     token_group_ids)

__all__ = ["MoE", "Experts", "Routing", "RoutingStats", "route", "capacity", "dense_experts",
           "AuxLossAutoScaler", "moe_layers", "set_token_groups", "set_aux_loss_scale",
           "aux_loss", "record_routing", "token_group_ids"]


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
        # combined in x's dtype: under bf16 autocast the experts return bf16 rows, while the
        # residual stream (and this sum) stays fp32
        w = routing.weights[tok, slot, None].to(out.dtype)
        out = out.index_add(0, tok, y.to(out.dtype) * w)
    return out


class MoE(nn.Module):
    """Router + experts in place of a block's MLP; ``(B, S, H)`` in/out.

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``.
        experts: :class:`Experts`.
        dispatcher: ``None`` (dense path, :func:`dense_experts`) or a callable
            ``dispatcher(x (T, H), routing, experts, layer=..., recompute=...) -> (T, H)``,
            set by expert parallelism.
        token_groups, aux_scale: see :func:`set_token_groups`, :func:`set_aux_loss_scale`.
        last_stats: the :class:`RoutingStats` of the last forward.

    A forward that activation checkpointing recomputes during backward routes the same
    tokens again: it is not recorded a second time, and the dispatcher tags its
    all-to-alls ``pass="recompute"``.
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
        again = _recomputing()
        if self.dispatcher is None:
            y = dense_experts(xf, routing, self.experts)
        else:
            y = self.dispatcher(xf, routing, self.experts, layer=self.layer_id, recompute=again)
        if not again:
            self.last_stats = routing.stats
            if self._log is not None:
                self._log.append(routing.stats)
        y = y.view(shape)
        scale = self.aux_loss_weight * self.aux_scale
        if scale and torch.is_grad_enabled() and routing.aux.requires_grad:
            y = AuxLossAutoScaler.apply(y, routing.aux, scale)
        return y


def _recomputing() -> bool:
    """True while autograd's engine runs this forward (activation checkpointing recomputing
    it during backward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


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
