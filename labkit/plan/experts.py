"""The planner's mixture-of-experts numbers: expert parameters per GPU and their terms.

A block with ``E`` experts of the MLP's shape holds ``E · mlp_matrices · h · f`` expert
parameters; expert parallelism over ``ep`` ranks leaves ``E/ep`` of them on each GPU
(GShard, Lepikhin et al. 2020 §3.2; Fedus et al. 2022, Switch Transformer §2), while the
router (``h·E``) is dense and whole everywhere. Tokens reach their experts by all-to-all
(:func:`labkit.plan.comm.expert_all_to_all_bytes`).

**All-to-all time** (:func:`expert_all_to_all_time`), per layer and microbatch: each pass
moves a token's routed rows once in the dispatch direction and once in the combine
direction — forward (tokens to the experts, outputs back), backward (output gradients to
the experts, input gradients back), and again forward under full recomputation — each an
all-to-all over the ``ep`` group (:func:`labkit.plan.network.all_to_all_time`): inside the
server over NVLink, across through each GPU's own adapter, the slower of the two. Routing
is taken as balanced (a token's ``k`` routed experts uniform over the group), shared
experts stay on the token's rank. Where the runtime sends one copy per target server and
forwards inside it (DeepSeek-V3 §3.2.2), a token crosses the network once per server it
reaches: ``N·(1 − (1 − 1/N)^k)`` servers of the group's ``N``, at most the model's
``node_limit`` (DeepSeek-V3 §2.1.2: 4), of which ``(N−1)/N`` are not its own.
"""
from __future__ import annotations

from labkit.plan.comm import expert_all_to_all_bytes
from labkit.plan.network import all_to_all_time, collective_time, place

__all__ = ["expert_params", "expert_terms", "expert_all_to_all_time", "ep_placement"]


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


def ep_placement(cluster, layout):
    """Where an expert-parallel group lies: the first ``ep`` ranks of the ``dp·cp`` view
    (cp innermost, as :mod:`labkit.mesh` numbers it)."""
    cp, ep = layout.cp, layout.ep
    if ep % cp == 0:
        return place(cluster, (cp, layout.stride("cp")), (ep // cp, layout.stride("dp")))
    return place(cluster, (ep, layout.stride("cp")))


def expert_all_to_all_time(model, cluster, layout, runtime) -> dict:
    """The expert all-to-alls of ONE layer and microbatch on one rank.

    Returns:
        ``{"seconds", "bytes", "across_bytes", "placement", "passes"}``: seconds of all
        the layer's all-to-alls (forward, backward, recomputed forward), bytes the rank
        sends (``(n−1)/n`` of its send buffers) and the part that leaves its server,
        the group's :class:`~labkit.plan.network.Placement`, forward passes (1 or 2).
        Zeros when ``ep == 1``.
    """
    pl = ep_placement(cluster, layout)
    passes = 1 + (layout.checkpoint == "full")
    out = {"seconds": 0.0, "bytes": 0.0, "across_bytes": 0.0, "placement": pl,
           "passes": passes}
    n, g = pl.size, pl.per_server
    if n == 1:
        return out
    T = layout.microbatch * (model.seq_len // layout.cp)
    k = model.top_k - model.shared_experts
    width = 4 if runtime.param_bytes == 4 else 2
    w_d, w_c = runtime.a2a_widths or (width, width)
    servers = n // g
    inside = across = None
    if runtime.a2a_node_dedup and servers > 1:
        hit = servers * (1 - (1 - 1 / servers) ** k)
        if model.node_limit:
            hit = min(hit, model.node_limit)
        across = hit * (servers - 1) / servers / k      # of the rank's routed rows
        inside = (g - 1) / g                             # delivered or forwarded by NVLink
    total = secs = cross = 0.0
    for w, n_pass in ((w_d, passes + 1), (w_c, passes + 1)):
        S = T * k * model.d_model * w                    # one direction's send buffer
        a = None if across is None else across * S
        i = None if inside is None else inside * S
        secs += n_pass * all_to_all_time(S, pl, across_bytes=a, inside_bytes=i)
        total += n_pass * (n - 1) / n * S
        cross += n_pass * ((n - g) / n * S if a is None else a)
    # the per-expert token counts go first, every forward (latency-bound)
    secs += passes * collective_time("all_to_all", model.n_experts * 8, pl)
    total += passes * (n - 1) / n * model.n_experts * 8
    out.update(seconds=secs, bytes=total, across_bytes=cross)
    return out
