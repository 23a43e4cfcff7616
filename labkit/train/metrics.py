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
from .overlap import DP_AXES, overlap_fraction  # noqa: F401 - re-exported
from .comm_predict import (_bf16_weights, _cp_predicted, _dp_predicted,  # noqa: F401
                           _pp_predicted, _tp_predicted)

__all__ = ["run_steps", "steady_step_time", "memory_metrics", "predicted_memory",
           "comm_metrics", "comm_by_axis", "overlap_fraction", "flops_and_mfu", "DP_AXES"]


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
        # (only where fully_shard ran: its parameters are DTensors; one data rank runs no
        # data parallelism at all, and nothing is held twice)
        root = [p for m in setup.stages.values() for n, p in m.named_parameters()
                if not n.startswith("layers.") and getattr(p, "placements", None) is not None]
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
