"""The bytes each collective should move per training step, by mesh axis: the formulas
:func:`labkit.train.metrics.comm_metrics` sets beside what the rank's trace measured.

Data parallel: the ZeRO paper's 2Ψ / 2Ψ / 3Ψ × (K−1)/K (Rajbhandari et al. 2020); tensor
parallel: Shoeybi et al. 2019 §3, Korthikanti et al. 2022 §4.2 (sequence parallelism);
context parallel: :func:`labkit.parallel.context.measure.bytes_formula`; pipeline: one
boundary activation per cross-rank send of the schedule. Bytes sent by this rank per step.
The ViT shares the GPT's blocks, so its tp and cp bytes are the blocks' over its patch
tokens (:func:`vit_tokens`) plus its own ends (:func:`_vit_tp_predicted`, the pooled sum
in :func:`_cp_predicted`).
"""
from __future__ import annotations

from ..plan.comm import comm_bytes


def _dp_predicted(setup, elem: int) -> dict:
    """Bytes per collective the data-parallel wrappers should send per step: the ZeRO
    paper's 2Ψ / 2Ψ / 3Ψ × (K−1)/K, with the flat units' padding, per microbatch where the
    stage reduce-scatters (2–3) or gathers (3) every microbatch, minus the root unit's
    backward all-gather that ``keep_last`` saves, plus HSDP's all-reduce across replicas;
    ZeRO 0 with ``find_unused`` adds each wrapper's used-map all-reduce."""
    cfg, mg = setup.cfg, setup.mg
    if not setup.sharded:  # the experts are reduced over their own (edp) group
        dense = setup.rank_params - sum(p.numel() for p in setup.expert_params)
        # find_unused: each wrapper also all-reduces its used-map, one fp32 per parameter
        flags = sum(len(w.params) for w in setup.wrappers
                    if getattr(w, "find_unused", False) and getattr(w, "axis", None) == "dp")
        return {"all_reduce": comm_bytes("all_reduce", (dense + flags) * elem,
                                         mg.size("dp_cp"))}
    k, m = mg.size("fsdp"), mg.size("dp_replicate")
    micro = cfg.accum_steps if cfg.zero_stage >= 2 else 1
    out = {"reduce_scatter": 0.0, "all_gather": 0.0}
    for w in setup.sharded:
        size = sum(u.padded for u in w.units) * elem
        out["reduce_scatter"] += comm_bytes("reduce_scatter", size, k) * micro
        out["all_gather"] += comm_bytes("all_gather", size, k) * (2 * micro if cfg.zero_stage == 3
                                                                  else 1)
        if cfg.zero_stage == 3 and cfg.keep_last and w.root is not None:
            out["all_gather"] -= comm_bytes("all_gather", w.root.padded * elem, k) * micro
        if m > 1:
            out["all_reduce"] = out.get("all_reduce", 0.0) + comm_bytes("all_reduce", size / k, m)
    tied = setup.tied.param if setup.tied is not None else None
    if tied is not None and any(p is tied for p in setup.plain_params):
        tied = tied.numel() * 4  # the tied copy's own DDP all-reduce
        out["all_reduce"] = out.get("all_reduce", 0.0) + comm_bytes("all_reduce", tied,
                                                                    mg.size("dp_cp"))
    return out


def _tp_predicted(setup) -> dict:
    """Tensor-parallel bytes this rank sends per step, by collective (Shoeybi et al. 2019
    §3; Korthikanti et al. 2022 §4.2 with sequence parallelism), per microbatch:

    * each block (:func:`_tp_blocks`): two all-reduces of ``b·s·H`` forward and two backward,
      or with SP the same volume as all-gathers and reduce-scatters, plus SP's regathers,
      checkpoint recomputation and the whole-held weights' gradient all-reduces;
    * the embedding (first stage): its partial outputs all-reduced (SP: reduce-scattered,
      all-gathered back in backward); the head (last stage): its input's gradient
      all-reduced (SP: the input all-gathered, its gradient reduce-scattered);
    * the vocab-parallel cross-entropy: the max and the two sums of ``b·s`` logits rows,
      fp32 (all-reduces).

    ``s`` is the sequence this rank's attention sees (``S/cp``). A ViT has its own ends:
    :func:`_vit_tp_predicted`."""
    cfg = setup.cfg
    mc, t, sp = cfg.model_config, cfg.parallel.tp, cfg.sequence_parallel
    if mc.kind == "vit":
        return _vit_tp_predicted(setup)
    b, s, h = cfg.micro, mc.seq_len // cfg.parallel.cp, mc.d_model
    act, res, wgt = _tp_dtypes(setup)
    u_act = (t - 1) / t * b * s * h * act  # one all-gather or reduce-scatter of (b, s, H)
    u_res = (t - 1) / t * b * s * h * res
    out = _tp_blocks(setup, s)
    add = _adder(out, cfg.accum_steps)
    for m in setup.stages.values():
        if m.is_first:
            add("reduce_scatter", u_res) if sp else add("all_reduce", 2 * u_res)
            if sp:
                add("all_gather", u_res)
        if m.is_last:
            if sp:  # the final norm ran on S/T tokens: its weight gradient is summed too;
                # the head's input (res), gathered again in backward (compute dtype)
                add("all_gather", u_res + u_act)
                add("reduce_scatter", u_res)
                add("all_reduce", _ar(t, h * wgt))
            else:
                add("all_reduce", 2 * u_res)
            add("all_reduce", _ar(t, 3 * b * s * 4))
    return {op: float(v) for op, v in out.items() if v}


def vit_tokens(mc, cp: int = 1) -> int:
    """Tokens of one image each cp rank's ViT blocks see: the ``P = (image/patch)²`` patch
    tokens, plus the class token with ``pool="cls"`` (which only runs at ``cp = 1``), over
    ``cp``."""
    return ((mc.image_size // mc.patch_size) ** 2 + (mc.pool == "cls")) // cp


def _vit_tp_predicted(setup) -> dict:
    """The ViT's tensor-parallel bytes this rank sends per step (:mod:`labkit.parallel.vision`),
    by collective, per microbatch of ``b`` images with ``s`` = :func:`vit_tokens` tokens:

    * its blocks, the GPT's (:func:`_tp_blocks`);
    * nothing more without sequence parallelism: the patch projection, class token,
      position table, final norm and head are whole on every tp rank, and every tp rank
      computes the same loss (no vocabulary-parallel cross-entropy);
    * with SP: the embedded ``(b, s, H)`` sequence's gradient all-gathered in backward (its
      forward split moves nothing), the pooled ``(b, H)`` token sum all-reduced forward,
      and the final norm's weight gradient (``H``) all-reduced — all on the residual side.
    """
    cfg = setup.cfg
    mc, t, sp = cfg.model_config, cfg.parallel.tp, cfg.sequence_parallel
    b, s, h = cfg.micro, vit_tokens(mc, cfg.parallel.cp), mc.d_model
    _, res, wgt = _tp_dtypes(setup)
    out = _tp_blocks(setup, s)
    if sp:
        add = _adder(out, cfg.accum_steps)
        add("all_gather", (t - 1) / t * b * s * h * res)
        add("all_reduce", _ar(t, b * h * res) + _ar(t, h * wgt))
    return {op: float(v) for op, v in out.items() if v}


def _tp_dtypes(setup) -> tuple:
    """``(act, res, wgt)`` bytes per element of a tp region's two sides and of the whole-held
    weights' gradients. Under ``precision="bf16"`` the two sides of a tp region differ. A
    matmul's output (the row-parallel partial sums, and their gradients) is bf16 in both
    bf16 regimes. The residual side — the embedding's output, the norms' outputs that enter
    the column-parallel matmuls, and those tensors' gradients — is bf16 only where the
    weights are (ZeRO's bf16 flat units): under autocast over fp32 weights (ZeRO 0, or one
    data rank) the embedding lookup and the norm are not autocast ops, so they return fp32
    and the residual stream stays fp32, as in one process under autocast (the oracle's bf16
    regime). Casting them to bf16 before the collective would round the residual stream and
    sum the Q/K/V (gate/up) input gradients in bf16: the run would no longer compute what
    single-process autocast computes. So those collectives move fp32 there, and are counted
    so."""
    act = 2 if setup.cfg.precision == "bf16" else 4
    res = 2 if _bf16_weights(setup) else 4
    return act, res, res


def _ar(t: int, n: float) -> float:
    """All-reduce bytes one rank sends for ``n`` bytes over ``t`` ranks (ring)."""
    return 2 * (t - 1) / t * n


def _adder(out: dict, micro: int):
    def add(op: str, n: float) -> None:
        out[op] = out.get(op, 0.0) + n * micro
    return add


def _tp_blocks(setup, s: int) -> dict:
    """Tensor-parallel bytes of this rank's blocks per step, by collective, for ``s`` tokens
    per sequence (per microbatch, × the microbatches):

    * each block: two all-reduces of ``b·s·H`` forward (the row-parallel outputs) and two
      backward (the column-parallel inputs' gradients), or with SP the same volume as
      all-gathers (inputs forward, output gradients backward) and reduce-scatters (outputs
      forward, input gradients backward); again for the forward a recomputing checkpoint
      policy repeats; plus the all-reduce of the weight gradients held whole on every tp
      rank (SP's norms; K/V when ``kv_heads < tp``);
    * with SP each block's two column-parallel inputs are all-gathered again in backward:
      the job keeps the ``S/T`` shard (``regather``).

    Dtypes: :func:`_tp_dtypes`."""
    from ..parallel.tensor.measure import block_bytes_formula, block_weight_grad_bytes

    cfg = setup.cfg
    mc, t, sp = cfg.model_config, cfg.parallel.tp, cfg.sequence_parallel
    b, h = cfg.micro, mc.d_model
    act, res, wgt = _tp_dtypes(setup)
    u_act = (t - 1) / t * b * s * h * act  # one all-gather or reduce-scatter of (b, s, H)
    u_res = (t - 1) / t * b * s * h * res
    # forward: the two regions' outputs; backward: the two regions' input gradients
    fwd = block_bytes_formula(b, s, h, t, sequence_parallel=sp, bytes_per_elem=act)["forward"]
    bwd = block_bytes_formula(b, s, h, t, sequence_parallel=sp, bytes_per_elem=res)["backward"]
    if mc.n_experts:  # the experts stay whole on every tp rank: only attention is split
        fwd, bwd = fwd / 2, bwd / 2
    layers = sum(len(m.layers) for m in setup.stages.values())
    out: dict = {}
    add = _adder(out, cfg.accum_steps)
    if sp:  # per region: all-gather input (res) + reduce-scatter output (act) forward,
        # all-gather output gradient (act) + reduce-scatter input gradient (res) backward,
        # and both column-parallel inputs gathered again in backward (regather): the shard
        # is kept in the compute dtype, so those move act bytes
        add("all_gather", layers * ((fwd * res / act + bwd * act / res) / 2 + 2 * u_act))
        add("reduce_scatter", layers * (fwd + bwd) / 2)
    else:
        add("all_reduce", layers * (fwd + bwd))
    if cfg.checkpoint != "none":
        # torch's non-reentrant checkpoint stops recomputing once the last activation the
        # segment's backward saved is back: the output collective of the segment's last
        # MLP is not repeated; every other region's output (a segment of checkpoint_every
        # blocks repeats its earlier blocks' MLP outputs too) and (SP) every input
        # all-gather are. An MoE block's MLP has no tp collective
        segments = layers
        if cfg.checkpoint == "every":
            segments = sum(-(-len(m.layers) // cfg.checkpoint_every)
                           for m in setup.stages.values())
        outputs = layers if mc.n_experts else 2 * layers - segments
        if sp:
            add("all_gather", layers * 2 * u_res)
            add("reduce_scatter", outputs * u_act)
        else:
            add("all_reduce", outputs * 2 * u_act)
    add("all_reduce", layers * block_weight_grad_bytes(h, mc.kv_heads * mc.head_dim, t,
                                                       mc.kv_heads, sequence_parallel=sp,
                                                       bytes_per_elem=wgt))
    return out


def _bf16_weights(setup) -> bool:
    """The rank computes with bf16 weights: bf16 with ZeRO's flat units (more than one data
    rank; :func:`labkit.train.data.bf16_parameters`); every other bf16 run autocasts over
    fp32 weights."""
    return setup.cfg.precision == "bf16" and bool(setup.sharded)


def _cp_predicted(setup) -> dict:
    """Context-parallel bytes this rank sends per step: each block's attention call, forward
    and backward (:func:`labkit.parallel.context.measure.bytes_formula`), per microbatch; a
    recomputing checkpoint policy runs the forward call twice. A ViT's sequence is its
    :func:`vit_tokens` (the patches: cp needs ``pool="mean"``), and its pooled ``(b, H)``
    token sum is all-reduced over cp forward and backward
    (:class:`~labkit.parallel.vision.SumOverContext`), on the residual side."""
    from ..parallel.context.measure import bytes_formula

    cfg = setup.cfg
    mc, cp = cfg.model_config, cfg.parallel.cp
    vit = mc.kind == "vit"
    per = bytes_formula(cfg.cp_method, cp, batch=cfg.micro,
                        heads=mc.n_heads // cfg.parallel.tp,
                        kv_heads=mc.kv_heads // cfg.parallel.tp,
                        seq_len=vit_tokens(mc) if vit else mc.seq_len,
                        head_dim=mc.head_dim, elem_bytes=2 if cfg.precision == "bf16" else 4)
    layers = sum(len(m.layers) for m in setup.stages.values())
    fwd = per["forward"] * (2 if cfg.checkpoint != "none" else 1)
    n = layers * cfg.accum_steps
    if cfg.cp_method == "allgather":  # gather K/V forward, reduce-scatter dK/dV backward
        out = {"all_gather": float(fwd * n), "reduce_scatter": float(per["backward"] * n)}
    else:
        out = {"send" if cfg.cp_method == "ring" else "all_to_all":
               float((fwd + per["backward"]) * n)}
    if vit:
        res = _tp_dtypes(setup)[1]
        out["all_reduce"] = float(2 * _ar(cp, cfg.micro * mc.d_model * res) * cfg.accum_steps)
    return out


def _pp_predicted(setup) -> dict:
    """Pipeline bytes this rank sends per step: one ``(b, S/cp, H)`` boundary tensor (fp32,
    or bf16 with ZeRO's bf16 weights; ``(b, S/(cp·tp), H)`` with sequence parallelism, whose
    residual stream each tp rank holds a slice of) per cross-rank SEND_F/SEND_B of the
    schedule, per flush, plus the tied-embedding exchange."""
    from ..parallel.pipeline.schedules import with_comms

    cfg, mg = setup.cfg, setup.mg
    mc = cfg.model_config
    # ZeRO's bf16 flat units hold bf16 weights, so the residual stream a stage hands on is
    # bf16; under autocast over fp32 weights (ZeRO 0, or ZeRO over one data rank, which
    # builds no flat units) it stays fp32
    elem = 2 if _bf16_weights(setup) else 4
    seq = mc.seq_len // cfg.parallel.cp // (cfg.parallel.tp if cfg.sequence_parallel else 1)
    act = cfg.micro * seq * mc.d_model * elem
    sends = sum(1 for a in with_comms(setup.schedule).actions[mg.index("pp")]
                if a.kind in ("SEND_F", "SEND_B"))
    out = {"send": float(sends * act * cfg.flushes)}
    if setup.tied is not None and setup.tied.param is not None:
        out["send"] += setup.tied.param.numel() * 4
    return out
