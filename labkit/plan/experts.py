"""The planner's mixture-of-experts numbers: expert parameters per GPU and their terms.

A block with ``E`` experts of the MLP's shape holds ``E · mlp_matrices · h · f`` expert
parameters; expert parallelism over ``ep`` ranks leaves ``E/ep`` of them on each GPU
(GShard, Lepikhin et al. 2020 §3.2; Fedus et al. 2022, Switch Transformer §2), while the
router (``h·E``) is dense and whole everywhere. Tokens reach their experts by all-to-all
(:func:`labkit.plan.comm.expert_all_to_all_bytes`).
"""
from __future__ import annotations

from labkit.plan.comm import expert_all_to_all_bytes

__all__ = ["expert_params", "expert_terms"]


def expert_params(model, layout, layers: list) -> list:
    """Expert parameters each pipeline rank holds: ``layers_i · (E/ep) · mlp_matrices · h ·
    f`` (a :class:`~labkit.plan.models.PlanModel`, a :class:`~labkit.plan.layout.Layout`,
    layers per pipeline rank)."""
    return [n * model.layer_expert_params / layout.ep for n in layers]


def expert_terms(m, layout, r, layers: list, mem_rank: int, Term) -> dict:
    """``{name: Term}``: the experts a GPU holds, its expert parameters on pipeline rank
    ``mem_rank``, the router's and a block's active parameters, and (``ep > 1``) the
    all-to-all bytes of one layer and microbatch under balanced routing. ``Term`` is
    :class:`labkit.plan.estimate.Term`, passed in so this module does not import its caller."""
    out: dict = {}

    def term(name, value, unit, formula, source=""):
        out[name] = Term(name, float(value), unit, formula, source)

    src = "Fedus et al. 2022 (Switch Transformer) §2; Lepikhin et al. 2020 (GShard) §3.2"
    term("moe.experts_per_gpu", m.n_experts // layout.ep, "experts per layer", "E / ep", src)
    term("moe.expert_params_per_gpu", expert_params(m, layout, layers)[mem_rank], "params",
         "layers_i · (E/ep) · mlp_matrices · h · f", src)
    term("moe.router_params_per_layer", m.router_params, "params", "h · E (whole on every "
         "tp rank)", src)
    term("moe.active_params_per_layer", m.layer_matmul_params, "params",
         "attention + h·E + k · mlp_matrices · h · f", src)
    if layout.ep == 1:
        return out
    tokens = layout.microbatch * (m.seq_len // layout.cp)
    # rows move at the compute width: fp32, or 16-bit under mixed precision
    width = 4 if r.param_bytes == 4 else 2
    a2a = expert_all_to_all_bytes(tokens, m.d_model, m.top_k, m.n_experts, layout.ep,
                                  bytes_per_elem=width, recompute=layout.checkpoint == "full")
    for k in ("counts", "dispatch", "combine", "total"):
        term(f"moe.all_to_all.{k}", a2a[k], "bytes per layer per microbatch",
             {"counts": "(ep−1)/ep · E · 8 per forward",
              "dispatch": "f · b·s/cp · k · h · bytes, forward + backward (f = (ep−1)/ep)",
              "combine": "f · b·s/cp · k · h · bytes, forward + backward",
              "total": "counts + dispatch + combine"}[k],
             "balanced routing; labkit.plan.comm.expert_all_to_all_bytes")
    return out
