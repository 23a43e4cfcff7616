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
from typing import Callable, Iterable, Sequence

import torch

from ..measure.memory import measure_memory
from ..plan.comm import comm_bytes, dp_step_comm_bytes
from ..plan.memory import model_state_bytes

__all__ = ["run_steps", "steady_step_time", "memory_metrics", "predicted_memory",
           "comm_metrics", "comm_by_axis", "overlap_fraction", "flops_and_mfu"]


def run_steps(ctx, cfg, step_fn: Callable, model, opt, device,
              track: Iterable[torch.Tensor] = ()) -> tuple:
    """Run ``cfg.steps`` steps, timing them and measuring memory in the last one.

    ``step_fn(s, mark)`` runs step ``s`` and returns its loss; ``mark(label)`` records a
    memory snapshot (a no-op outside the tracked step). With ``cfg.measure_memory`` the last
    step runs under :func:`~labkit.measure.memory.measure_memory` and is not timed, unless
    it is the only step; its events are tagged ``instrumented="memory"``.

    Returns:
        ``(losses, times, report)``: per-step losses, the timed steps' seconds, and the
        :class:`~labkit.measure.memory.MemoryReport` (or ``None``).
    """
    losses, times, report = [], [], None
    mem_step = cfg.steps - 1 if cfg.measure_memory else None
    for s in range(cfg.steps):
        ctx.tracer.step = s
        t0 = ctx.tracer.now()
        if s == mem_step:
            holder: dict = {}
            report = measure_memory(lambda mark: holder.setdefault("loss", step_fn(s, mark)),
                                    model, opt, device, track=track)
            losses.append(holder["loss"])
            if cfg.steps == 1:
                times.append(ctx.tracer.now() - t0)
            for e in ctx.tracer.events:
                if e.step == s:
                    e.args["instrumented"] = "memory"
            continue
        losses.append(step_fn(s, lambda label: None))
        times.append(ctx.tracer.now() - t0)
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
    parameters kept outside the units, replicated (4/4/8)."""
    cfg, mg = setup.cfg, setup.mg
    plain = sum(p.numel() for p in setup.plain_params)
    out = model_state_bytes(plain, 1, 0, mixed_precision=False)
    if setup.sharded:
        padded = sum(u.padded for w in setup.sharded for u in w.units)
        units = model_state_bytes(padded, mg.size("fsdp"), cfg.zero_stage,
                                  mixed_precision=cfg.precision == "bf16")
        out = {c: out[c] + units[c] for c in out}
    return {c: int(v) for c, v in out.items()}


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
    if cfg.parallel.cp > 1:
        predicted["cp"] = _cp_predicted(setup)
    if cfg.parallel.tp > 1:
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

    * each block: two all-reduces of ``b·s·H`` forward and two backward, or with SP the
      same volume as all-gathers and reduce-scatters
      (:func:`labkit.parallel.tensor.measure.block_bytes_formula`), again for the forward a
      recomputing checkpoint policy repeats; plus the all-reduce of the weight gradients held
      whole on every tp rank (SP's norms; K/V when ``kv_heads < tp``);
    * the embedding (first stage): its partial outputs all-reduced (SP: reduce-scattered,
      all-gathered back in backward); the head (last stage): its input's gradient
      all-reduced (SP: the input all-gathered, its gradient reduce-scattered);
    * with SP each column-parallel input (the block's two, the head's) is all-gathered
      again in backward: the job keeps the ``S/T`` shard (``regather``);
    * the vocab-parallel cross-entropy: the max and the two sums of ``b·s`` logits rows,
      fp32 (all-reduces).

    ``s`` is the sequence this rank's attention sees (``S/cp``); activations are bf16 under
    ``precision="bf16"``."""
    from ..parallel.tensor.measure import block_bytes_formula, block_weight_grad_bytes

    cfg = setup.cfg
    mc, t, sp = cfg.model_config, cfg.parallel.tp, cfg.sequence_parallel
    b, s, h = cfg.micro, mc.seq_len // cfg.parallel.cp, mc.d_model
    act = 2 if cfg.precision == "bf16" else 4
    wgt = 2 if (cfg.precision == "bf16" and setup.sharded) else 4
    unit = (t - 1) / t * b * s * h * act  # one all-gather or reduce-scatter of (b, s, H)
    ar = lambda n: 2 * (t - 1) / t * n  # noqa: E731 - all-reduce bytes of n bytes
    blk = block_bytes_formula(b, s, h, t, sequence_parallel=sp, bytes_per_elem=act)
    if mc.n_experts:  # the experts stay whole on every tp rank: only attention is split
        blk = {k: v / 2 for k, v in blk.items()}
    layers = sum(len(m.layers) for m in setup.stages.values())
    out: dict = {}

    def add(op: str, n: float) -> None:
        out[op] = out.get(op, 0.0) + n * cfg.accum_steps

    if sp:  # the job re-gathers both column-parallel inputs in backward (regather)
        add("all_gather", layers * (blk["forward"] + blk["backward"]) / 2 + layers * 2 * unit)
        add("reduce_scatter", layers * (blk["forward"] + blk["backward"]) / 2)
    else:
        add("all_reduce", layers * (blk["forward"] + blk["backward"]))
    if cfg.checkpoint != "none":
        # torch's non-reentrant checkpoint stops recomputing once the last activation the
        # block's backward saved is back: the MLP's output collective is not repeated,
        # the attention's output and (SP) the two input all-gathers are
        if sp:
            add("all_gather", layers * 2 * unit)
            add("reduce_scatter", layers * unit)
        else:
            add("all_reduce", layers * 2 * unit)
    add("all_reduce", layers * block_weight_grad_bytes(h, mc.kv_heads * mc.head_dim, t,
                                                       mc.kv_heads, sequence_parallel=sp,
                                                       bytes_per_elem=wgt))
    for m in setup.stages.values():
        if m.is_first:
            add("reduce_scatter", unit) if sp else add("all_reduce", 2 * unit)
            if sp:
                add("all_gather", unit)
        if m.is_last:
            if sp:  # the final norm ran on S/T tokens: its weight gradient is summed too;
                add("all_gather", 2 * unit)  # the head's input, gathered again in backward
                add("reduce_scatter", unit)
                add("all_reduce", ar(h * wgt))
            else:
                add("all_reduce", 2 * unit)
            add("all_reduce", ar(3 * b * s * 4))
    return {op: float(v) for op, v in out.items() if v}


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
    """Pipeline bytes this rank sends per step: one ``(b, S, H)`` boundary tensor (fp32, or
    bf16 with ZeRO's bf16 weights) per cross-rank SEND_F/SEND_B of the schedule, per flush,
    plus the tied-embedding exchange."""
    from ..parallel.pipeline.schedules import with_comms

    cfg, mg = setup.cfg, setup.mg
    mc = cfg.model_config
    # ZeRO's bf16 flat units hold bf16 weights, so the residual stream a stage hands on is
    # bf16; under autocast over fp32 weights (ZeRO 0) it stays fp32
    elem = 2 if cfg.precision == "bf16" and cfg.zero_stage >= 1 else 4
    act = cfg.micro * (mc.seq_len // cfg.parallel.cp) * mc.d_model * elem
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
