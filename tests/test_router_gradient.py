"""Top-1 routing passes the language-model loss to the router (Switch Transformer, Fedus et
al. 2022, §2.1: the expert output is scaled by its router probability ``p``).

The reference below is plain torch written from the paper, sharing no code with
``labkit.models``: softmax router, argmax expert, capacity in GShard order (Lepikhin et al.
2020, §2.2: within a group, tokens in order, at most ``ceil(cf · k · T / E)`` per expert),
the output ``p · expert(x)``. With the aux-loss weight 0 the router's whole gradient comes
through ``p``: renormalising one probability (weight 1.0) would make it exactly zero.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from jobs_expert import LayerCase, build_case, layer_step

from labkit.models.moe import set_token_groups

CASES = [LayerCase(ep=2, top_k=1, aux_loss_weight=0.0, tokens=12),
         LayerCase(ep=2, top_k=1, aux_loss_weight=0.0, tokens=12, capacity_factor=0.75,
                   pattern="skewed")]


def switch_router_grad(case: LayerCase) -> torch.Tensor:
    """``d/dW`` of ``Σ_r Σ_t y·target / (P·T)``, one token group per rank, in float64."""
    layer, x, target = build_case(case)
    w = layer.router.weight.detach().double().requires_grad_(True)
    w1, w3, w2 = (getattr(layer.experts, n).detach().double() for n in ("w1", "w3", "w2"))
    p_ranks, t, e = case.ep, case.tokens, case.n_experts
    total = torch.zeros((), dtype=torch.float64)
    for r in range(p_ranks):                                  # each rank is a group
        xs = x[r].double()
        probs = torch.softmax(xs @ w.t(), dim=-1)
        cap = (math.ceil(case.capacity_factor * t / e) if case.capacity_factor is not None
               else t)
        used = [0] * e
        for i in range(t):
            j = int(probs[i].argmax())
            if used[j] >= cap:
                continue                                      # dropped: adds nothing
            used[j] += 1
            h = F.silu(w1[j] @ xs[i]) * (w3[j] @ xs[i])
            total = total + probs[i, j] * (w2[j] @ h) @ target[r, i].double()
    (total / (p_ranks * t)).backward()
    return w.grad


def one_process_router_grad(case: LayerCase) -> torch.Tensor:
    layer, x, target = build_case(case)
    set_token_groups(layer, case.ep)
    y = layer(x)
    ((y * target).sum() / (case.ep * case.tokens)).backward()
    return layer.router.weight.grad


@pytest.mark.parametrize("case", CASES, ids=["top1", "top1-capacity"])
def test_top1_router_gradient_equals_switch_on_every_rank(cluster2, case):
    ref = switch_router_grad(case)
    assert ref.abs().max() > 1e-3                             # the path exists
    torch.testing.assert_close(one_process_router_grad(case).double(), ref, atol=1e-6,
                               rtol=1e-5)
    r = cluster2.run(layer_step, case, nranks=2)
    if case.capacity_factor is not None:
        assert any(out["dropped"] for out in r.outputs)      # the capacity really drops
    for out in r.outputs:                                     # every rank
        assert out["router_grad"].abs().max() > 1e-3
        torch.testing.assert_close(out["router_grad"].double(), ref, atol=1e-6, rtol=1e-5)
