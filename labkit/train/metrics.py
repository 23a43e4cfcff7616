"""What the training job measures on each rank, beside what :mod:`labkit.plan` predicts.

* **Step time**: the median of the steady steps (the first pays lazy allocation of Adam
  state; the memory-tracked step is not timed unless it is the only one, and its trace
  events carry ``args["instrumented"] = "memory"`` so a timeline can mark it).
* **Memory by category** from torch's ``MemTracker`` in the last step
  (:mod:`labkit.measure.memory`), beside the model state :func:`labkit.plan.model_state_bytes`
  predicts for this rank's parameters, ZeRO stage and shard count.
* **Communication**: bytes per mesh axis and collective of one steady step from this rank's
  trace, beside the formulas (data parallel: 2Ψ / 3Ψ per the ZeRO stage; pipeline: one
  boundary activation per send).
* **FLOPs and MFU/HFU**: torch's FLOP counter on one microbatch through this rank's stages
  (a fresh copy, cached per shape), × microbatches per step, this rank's share of the
  ``tp · cp`` ranks holding the same stages, over the peak of the dtype that ran
  (:func:`labkit.measure.rank_peak.rank_peak`, with its age and conditions).
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..faults import inject
from ..measure.memory import measure_memory
from ..plan.comm import comm_bytes, dp_step_comm_bytes
from ..plan.memory import model_state_bytes

__all__ = ["run_steps", "steady_step_time", "memory_metrics", "predicted_memory",
           "comm_metrics", "comm_by_axis", "overlap_fraction", "flops_and_mfu"]


def run_steps(ctx, cfg, step_fn: Callable, model, opt, device,
              track: Iterable[torch.Tensor] = (), start: int = 0,
              after_step: Optional[Callable] = None) -> tuple:
    """Run steps ``start … cfg.steps − 1``, timing them and measuring memory in the last.

    ``step_fn(s, mark)`` runs step ``s`` and returns its loss; ``mark(label)`` records a
    memory snapshot (a no-op outside the tracked step). With ``cfg.measure_memory`` the last
    step runs under :func:`~labkit.measure.memory.measure_memory` and is not timed, unless
    it is the only step; its events are tagged ``instrumented="memory"``. ``after_step(s)``
    runs after step ``s``, outside its timing (a snapshot save). A run resumed from a
    snapshot starts at ``start`` > 0.

    Returns:
        ``(losses, times, report)``: per-step losses, the timed steps' seconds, and the
        :class:`~labkit.measure.memory.MemoryReport` (or ``None``).
    """
    losses, times, report = [], [], None
    mem_step = cfg.steps - 1 if cfg.measure_memory else None
    for s in range(start, cfg.steps):
        ctx.tracer.step = s
        inject.on_step(s)  # the flight record's step; an injected kill or straggler delay
        t0 = ctx.tracer.now()
        if s == mem_step:
            holder: dict = {}
            report = measure_memory(lambda mark: holder.setdefault("loss", step_fn(s, mark)),
                                    model, opt, device, track=track)
            losses.append(holder["loss"])
            if cfg.steps - start == 1:
                times.append(ctx.tracer.now() - t0)
            for e in ctx.tracer.events:
                if e.step == s:
                    e.args["instrumented"] = "memory"
        else:
            losses.append(step_fn(s, lambda label: None))
            times.append(ctx.tracer.now() - t0)
        if after_step is not None:
            after_step(s)
    return losses, times, report


def steady_step_time(times: Sequence[float]) -> float:
    """Median step time (s) of ``times[1:]`` (or ``times`` with one); NaN when empty."""
    steady = list(times[1:] or times)
    return statistics.median(steady) if steady else float("nan")


def memory_metrics(report, setup) -> dict:
    """Plain-data memory of the tracked step (bytes).

    ``peak`` is by category at the highest total; ``model_state`` each of parameters /
    gradients / optimizer at its largest over the step's marks (gradients exist only
    between backward and ``zero_grad``, so the breakdown at the peak can show none).
    Mixed precision's fp32 master shards are optimizer state (MemTracker calls them
    "other", as they are not module parameters); DDP bucket buffers exist before the
    tracked step, so they are added to "other" by their known size.
    """
    master = sum(w.shard_bytes["master"] for w in setup.sharded)
    bucket = sum(getattr(w, "bucket_bytes", 0) for w in setup.wrappers)

    def fix(snap: dict) -> dict:
        snap = dict(snap)
        snap["other"] = snap.get("other", 0) - master + bucket
        snap["optimizer"] = snap.get("optimizer", 0) + master
        return snap

    peak = fix(report.peak)
    marks = [fix(v) for _, v in report.timeline]
    out = {"peak": peak, "peak_total": sum(peak.values()),
           "model_state": {c: max(s.get(c, 0) for s in marks)
                           for c in ("parameters", "gradients", "optimizer")},
           "timeline": [[lbl, fix(v)] for lbl, v in report.timeline],
           "allocator_peak": report.allocator_peak,
           "working_set": {"bucket_buffers": bucket}}
    if setup.sharded:
        out["working_set"]["inflight_unit_grads"] = max(w.max_inflight_grad_bytes
                                                        for w in setup.sharded)
        if setup.cfg.zero_stage == 3:
            out["working_set"]["gathered_units"] = max(w.max_gathered_bytes
                                                       for w in setup.sharded)
    return out


def predicted_memory(setup) -> dict:
    """Model-state bytes this rank should hold (:func:`labkit.plan.model_state_bytes`):
    flat units at the ZeRO stage over the ``K`` shards, counting the units' padding to a
    multiple of ``K`` elements (fp32 4/4/8 or mixed 2/2/12 bytes per parameter), plus any
    parameters kept outside the units, replicated (4/4/8) — or, under PyTorch's FSDP2
    (``impl="torch"``, ZeRO 3), sharded by its own rule (:func:`fsdp2_shard_elements`) —
    plus AdamW's step counter, one 4-byte scalar tensor per parameter tensor it steps
    (torch keeps ``state["step"]`` as a tensor), which the memory tracker counts as
    optimizer state."""
    cfg, mg = setup.cfg, setup.mg
    out = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    one = model_state_bytes(1, 1, 0, mixed_precision=False)
    for p in setup.plain_params:
        padded, local = fsdp2_shard_elements(p)
        out["parameters"] += padded * one["parameters"]
        out["gradients"] += padded * one["gradients"]
        out["optimizer"] += local * one["optimizer"]
    if cfg.impl == "torch" and cfg.zero_stage == 3:
        # FSDP2 keeps the root module's parameters (those outside the blocks it shards on
        # their own: embedding, final norm, head) unsharded from forward to backward (the
        # root's reshard_after_forward is False: backward would gather them again at once),
        # so at its largest this rank holds their whole padded size too
        root = [p for m in setup.stages.values() for n, p in m.named_parameters()
                if not n.startswith("layers.")]
        out["parameters"] += sum(fsdp2_shard_elements(p)[0] * _shards(p) for p in root) \
            * one["parameters"]
    if setup.sharded:
        padded = sum(u.padded for w in setup.sharded for u in w.units)
        units = model_state_bytes(padded, mg.size("fsdp"), cfg.zero_stage,
                                  mixed_precision=cfg.precision == "bf16")
        out = {c: out[c] + units[c] for c in out}
    out["optimizer"] += 4 * sum(len(g["params"]) for g in setup.opt.param_groups)
    out = {c: int(v) for c, v in out.items()}
    out["total"] = sum(out.values())
    return out


def _shards(p) -> int:
    """The ranks a DTensor parameter is sharded over (1 for a plain tensor)."""
    placements = getattr(p, "placements", ())
    return int(torch.tensor([p.device_mesh.size(d) for d, pl in enumerate(placements)
                             if pl.is_shard()] or [1]).prod())


def fsdp2_shard_elements(p) -> tuple:
    """``(padded, local)`` elements of parameter ``p`` this rank holds: its whole
    ``numel()`` twice for a plain tensor; for a DTensor that PyTorch's FSDP2
    (``fully_shard``) sharded along dim 0 over ``K`` ranks, torch's rule
    (``torch.distributed.fsdp._fully_shard._fsdp_param``): dim 0 is cut in ``torch.chunk``
    pieces of ``⌈d₀/K⌉`` rows (the last ranks may get fewer, or none), each rank's parameter
    lives in a buffer padded to ``⌈d₀/K⌉`` rows (so are its gradients, views into the
    padded reduce-scatter output), while AdamW's moments (``zeros_like`` of the unpadded
    shard) hold only the rows the rank owns."""
    placements = getattr(p, "placements", None)
    if placements is None:
        return p.numel(), p.numel()
    mesh, d0 = p.device_mesh, p.shape[0]
    k, index = 1, 0
    for dim, pl in enumerate(placements):
        if pl.is_shard():
            if pl.dim != 0:
                raise ValueError(f"FSDP2 shards dim 0; this parameter is sharded on {pl.dim}")
            index = index * mesh.size(dim) + mesh.get_local_rank(dim)
            k *= mesh.size(dim)
    rest = p.numel() // d0 if d0 else 0
    chunk = -(-d0 // k)
    rows = max(0, min(d0, (index + 1) * chunk) - index * chunk)
    return chunk * rest, rows * rest


def comm_by_axis(events, step: int, rank: int) -> dict:
    """``{axis: {op: bytes sent}}`` of this rank's communication in ``step``."""
    out: dict = {}
    for e in events:
        if e.cat in ("comm", "p2p") and e.step == step and e.rank == rank:
            ops = out.setdefault(e.axis or "world", {})
            ops[e.op] = ops.get(e.op, 0.0) + e.bytes_sent
    return out


def overlap_fraction(events, step: int, rank=None) -> dict:
    """Fraction of ZeRO-3 all-gather time hidden under compute in ``step``, from the trace.

    An all-gather's span runs from issue to the return of its ``wait``; the ``"wait"``
    events are the time the compute thread sat blocked on one. Hidden = span − wait.
    Returns ``{"forward", "backward", "total"}`` (``None`` where nothing was gathered: a
    one-rank shard group's "all-gathers" move no bytes and hide nothing).
    """
    out = {}
    for phase in ("forward", "backward", None):
        ag = sum(e.duration for e in events if e.op == "all_gather" and e.step == step
                 and e.bytes_sent > 0 and (rank is None or e.rank == rank)
                 and e.args.get("phase") in ((phase,) if phase else ("forward", "backward")))
        wait = sum(e.duration for e in events if e.cat == "wait" and e.step == step
                   and (rank is None or e.rank == rank)
                   and (phase is None or e.args.get("phase") == phase))
        out[phase or "total"] = (min(1.0, max(0.0, 1.0 - wait / ag)) if ag > 0 else None)
    return out


def comm_metrics(ctx, setup, step: int) -> dict:
    """Measured bytes per axis and op in ``step`` beside the predicted data-parallel and
    pipeline traffic."""
    cfg, mg = setup.cfg, setup.mg
    measured = comm_by_axis(ctx.tracer.events, step, ctx.rank)
    elem = 2 if (cfg.precision == "bf16" and setup.sharded) else 4
    predicted: dict = {}
    n = mg.size("dp_cp")
    # PyTorch's FSDP2 and pipelining talk past labkit.comm (their bytes are not traced);
    # its DDP runs its buckets through labkit.comm by a comm hook
    if n > 1 and (cfg.impl == "labkit" or cfg.zero_stage == 0):
        predicted["dp"] = _dp_predicted(setup, elem)
    if setup.expert_params and mg.size("edp") > 1:
        predicted["edp"] = {"all_reduce": comm_bytes(
            "all_reduce", sum(p.numel() for p in setup.expert_params) * 4, mg.size("edp"))}
    if cfg.parallel.pp > 1 and cfg.impl == "labkit":
        predicted["pp"] = _pp_predicted(setup)
    gpt = cfg.model_config.kind == "gpt"  # the ViT's tp/cp bytes have no formula here yet
    if cfg.parallel.cp > 1 and gpt:
        predicted["cp"] = _cp_predicted(setup)
    if cfg.parallel.tp > 1 and gpt:
        predicted["tp"] = _tp_predicted(setup)
    total = sum(v for ops in measured.values() for v in ops.values())
    return {"comm_bytes_by_axis": measured, "comm_predicted_by_axis": predicted,
            "comm_bytes_per_step": total,
            "comm_bytes_predicted": sum(v for ops in predicted.values() for v in ops.values()),
            "dp_formula_bytes": dp_step_comm_bytes(setup.rank_params, n, elem,
                                                   cfg.zero_stage if setup.sharded else 0)
            if n > 1 else 0.0}


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

    * each block: two all-reduces of ``b·s·H`` forward (the row-parallel outputs) and two
      backward (the column-parallel inputs' gradients), or with SP the same volume as
      all-gathers (inputs forward, output gradients backward) and reduce-scatters (outputs
      forward, input gradients backward); again for the forward a recomputing checkpoint
      policy repeats; plus the all-reduce of the weight gradients held whole on every tp
      rank (SP's norms; K/V when ``kv_heads < tp``);
    * the embedding (first stage): its partial outputs all-reduced (SP: reduce-scattered,
      all-gathered back in backward); the head (last stage): its input's gradient
      all-reduced (SP: the input all-gathered, its gradient reduce-scattered);
    * with SP each column-parallel input (the block's two, the head's) is all-gathered
      again in backward: the job keeps the ``S/T`` shard (``regather``);
    * the vocab-parallel cross-entropy: the max and the two sums of ``b·s`` logits rows,
      fp32 (all-reduces).

    ``s`` is the sequence this rank's attention sees (``S/cp``). Under ``precision="bf16"``
    the two sides of a tp region differ. A matmul's output (the row-parallel partial sums,
    and their gradients) is bf16 in both bf16 regimes. The residual side — the embedding's
    output, the norms' outputs that enter the column-parallel matmuls, and those tensors'
    gradients — is bf16 only where the weights are (ZeRO's bf16 flat units): under autocast
    over fp32 weights (ZeRO 0, or one data rank) the embedding lookup and the norm are not
    autocast ops, so they return fp32 and the residual stream stays fp32, as in one process
    under autocast (the oracle's bf16 regime). Casting them to bf16 before the collective
    would round the residual stream and sum the Q/K/V (gate/up) input gradients in bf16: the
    run would no longer compute what single-process autocast computes. So those
    collectives move fp32 there, and are counted so."""
    from ..parallel.tensor.measure import block_bytes_formula, block_weight_grad_bytes

    cfg = setup.cfg
    mc, t, sp = cfg.model_config, cfg.parallel.tp, cfg.sequence_parallel
    b, s, h = cfg.micro, mc.seq_len // cfg.parallel.cp, mc.d_model
    act = 2 if cfg.precision == "bf16" else 4   # matmul outputs and their gradients
    res = 2 if _bf16_weights(setup) else 4      # residual side: embedding, norm outputs
    wgt = res
    u_act = (t - 1) / t * b * s * h * act  # one all-gather or reduce-scatter of (b, s, H)
    u_res = (t - 1) / t * b * s * h * res
    ar = lambda n: 2 * (t - 1) / t * n  # noqa: E731 - all-reduce bytes of n bytes
    # forward: the two regions' outputs; backward: the two regions' input gradients
    fwd = block_bytes_formula(b, s, h, t, sequence_parallel=sp, bytes_per_elem=act)["forward"]
    bwd = block_bytes_formula(b, s, h, t, sequence_parallel=sp, bytes_per_elem=res)["backward"]
    if mc.n_experts:  # the experts stay whole on every tp rank: only attention is split
        fwd, bwd = fwd / 2, bwd / 2
    layers = sum(len(m.layers) for m in setup.stages.values())
    out: dict = {}

    def add(op: str, n: float) -> None:
        out[op] = out.get(op, 0.0) + n * cfg.accum_steps

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
        # block's backward saved is back: the MLP's output collective is not repeated,
        # the attention's output and (SP) the two input all-gathers are
        if sp:
            add("all_gather", layers * 2 * u_res)
            add("reduce_scatter", layers * u_act)
        else:
            add("all_reduce", layers * 2 * u_act)
    add("all_reduce", layers * block_weight_grad_bytes(h, mc.kv_heads * mc.head_dim, t,
                                                       mc.kv_heads, sequence_parallel=sp,
                                                       bytes_per_elem=wgt))
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
                add("all_reduce", ar(h * wgt))
            else:
                add("all_reduce", 2 * u_res)
            add("all_reduce", ar(3 * b * s * 4))
    return {op: float(v) for op, v in out.items() if v}


def _bf16_weights(setup) -> bool:
    """The rank computes with bf16 weights: bf16 with ZeRO's flat units (more than one data
    rank; :func:`labkit.train.data.bf16_parameters`); every other bf16 run autocasts over
    fp32 weights."""
    return setup.cfg.precision == "bf16" and bool(setup.sharded)


def _cp_predicted(setup) -> dict:
    """Context-parallel bytes this rank sends per step: each block's attention call, forward
    and backward (:func:`labkit.parallel.context.measure.bytes_formula`), per microbatch; a
    recomputing checkpoint policy runs the forward call twice."""
    from ..parallel.context.measure import bytes_formula

    cfg = setup.cfg
    mc = cfg.model_config
    per = bytes_formula(cfg.cp_method, cfg.parallel.cp, batch=cfg.micro,
                        heads=mc.n_heads // cfg.parallel.tp,
                        kv_heads=mc.kv_heads // cfg.parallel.tp, seq_len=mc.seq_len,
                        head_dim=mc.head_dim, elem_bytes=2 if cfg.precision == "bf16" else 4)
    layers = sum(len(m.layers) for m in setup.stages.values())
    fwd = per["forward"] * (2 if cfg.checkpoint != "none" else 1)
    n = layers * cfg.accum_steps
    if cfg.cp_method == "allgather":  # gather K/V forward, reduce-scatter dK/dV backward
        return {"all_gather": float(fwd * n), "reduce_scatter": float(per["backward"] * n)}
    op = "send" if cfg.cp_method == "ring" else "all_to_all"
    return {op: float((fwd + per["backward"]) * n)}


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


def flops_and_mfu(ctx, setup, step_time: float) -> dict:
    """FLOPs per step and MFU/HFU of this rank, as plain data.

    FLOPs are this rank's share of its replica's work (:mod:`labkit.train.flops`): over the
    ``tp · cp · pp`` ranks of a replica they add up to the whole model's count on the
    replica's batch. Returns

    * ``"flops_analytic"``: the same share from the config (GPT; ``None`` for a ViT), FLOP;
    * ``"flops_per_step"``: torch's counter, × microbatches, this rank's share (FLOP);
    * ``"hardware_flops_per_step"``: the same with the checkpoint policy's recomputation;
    * ``"peak_flops"``: FLOP/s of this device for the dtype that ran, with
      ``"peak_measured_at"`` (s since the epoch; ``None`` for a datasheet peak),
      ``"peak_age_s"``, ``"peak_conditions"`` (load average, other processes' cores, threads,
      ranks, cores when measured) and ``"peak_source"`` (``"cached"``, ``"measured: <why>"``,
      ``"datasheet"``);
    * ``"mfu"``, ``"hfu"``: fractions; ``None`` where not counted, or where they exceed 1;
    * ``"mfu_error"``: ``None``, or why MFU/HFU are not shown: a step's HFU above 100 % means
      the peak is not a ceiling (or the FLOPs or the time are wrong). A CPU peak is then
      measured again by all ranks; if HFU still exceeds 100 %, this names the numbers.
    """
    from ..measure.mfu import mfu as mfu_report
    from ..measure.rank_peak import any_rank, peak_metrics, rank_peak
    from .flops import rank_flops, rank_flops_analytic

    cfg = setup.cfg
    out: dict = {"flops_analytic": rank_flops_analytic(setup), "flops_per_step": None,
                 "hardware_flops_per_step": None, "peak_flops": None, "mfu": None, "hfu": None,
                 "mfu_error": None, **peak_metrics(None)}
    if not cfg.count_flops:
        return out
    flops = rank_flops(ctx, setup, recompute=False)
    hw = rank_flops(ctx, setup, recompute=True) if cfg.checkpoint != "none" else flops
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    reading = rank_peak(ctx, dtype)
    out.update(flops_per_step=float(flops), hardware_flops_per_step=float(hw))
    timed = bool(step_time) and step_time == step_time and step_time > 0

    def over(r) -> bool:  # HFU >= MFU, so HFU above 100 % is the first sign
        return r is not None and timed and hw / (r.flops * step_time) > 1.0

    if not ctx.is_cuda and any_rank(ctx, over(reading)):  # collective: all measure, or none
        reading = rank_peak(ctx, dtype, refresh=True)
    out.update(peak_flops=None if reading is None else reading.flops, **peak_metrics(reading))
    if reading is None or not timed:
        return out
    if over(reading):
        out["mfu_error"] = _mfu_error(flops, hw, step_time, reading)
        return out
    try:
        rep = mfu_report(flops, step_time, reading.flops, 1, hardware_flops_per_step=hw)
    except ValueError as e:  # above 100 % by a rounding the check above did not see
        out["mfu_error"] = str(e)
        return out
    out["mfu"], out["hfu"] = rep.mfu, rep.hfu
    return out


def _mfu_error(flops: float, hw: float, step_time: float, reading) -> str:
    age = "" if reading.measured_at != reading.measured_at else \
        f", measured {reading.age_s():.0f} s ago under {reading.conditions}"
    return (f"HFU {100 * hw / (reading.flops * step_time):.1f} % > 100 %: {hw:.4g} FLOP "
            f"({flops:.4g} model) in {step_time:.4g} s exceeds the peak "
            f"{reading.flops:.4g} FLOP/s ({reading.source}{age}); the peak is not a ceiling, "
            f"or the FLOPs or the step time are wrong")
