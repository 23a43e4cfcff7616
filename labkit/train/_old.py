"""The training job: a real model on real data, data-parallel, traced and measured.

``run(ctx, cfg)`` is what :func:`labkit.jobs.train` executes on each rank. One step is

    data → (forward → backward) × microbatches → gradient sync → optimizer

each phase a traced region. Measurements ride along without changing the numerics:

* step time: the median of the steady steps (the first step pays lazy allocation of Adam
  state and is excluded, as is the memory-tracked step when there are enough steps);
* memory by category: the last step runs under torch's ``MemTracker``
  (:mod:`labkit.measure.memory`), beside the prediction of :mod:`labkit.plan`;
* FLOPs: one microbatch's forward+backward counted by torch's FLOP counter on a separate
  copy of the model (cached per shape), beside the analytic 6·N + attention count;
* communication: bytes from this rank's trace events of one steady step, beside
  2(N−1)/N·|θ|·bytes per element.

``reference(cfg)`` trains the same model on the same global batches in one process, with no
communication, for parity checks.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Callable, Iterable, Sequence

import torch

from ..config import RunConfig
from ..measure.flops import count_flops, transformer_flops_per_token
from ..measure.memory import measure_memory
from ..measure.mfu import mfu as mfu_report
from ..measure.cpu_peak import calibrate_cpu_peak
from ..measure.rank_peak import rank_peak_flops
from ..models import build_model
from ..models.data import make_batch
from ..parallel.dp import DataParallel, torch_ddp, unique_parameters
from ..plan.comm import dp_step_comm_bytes
from ..plan.memory import model_state_bytes
from ..trace import region

__all__ = ["run", "reference", "flat_params", "local_rows", "local_batch", "run_steps",
           "steady_step_time", "flops_and_mfu"]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All trainable parameters (tied ones once), flattened into one fp32 CPU vector."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for _, p in unique_parameters(model)])


def _optimizer(model, cfg: RunConfig):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def local_rows(x: torch.Tensor, rank: int, dp: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch: rows ``[rank·B/dp, (rank+1)·B/dp)``
    of ``x`` (shape ``[B, ...]`` → ``[B/dp, ...]``, a view). ``B`` must be divisible by
    ``dp`` (``RunConfig.validate`` checks ``global_batch``)."""
    rows = x.shape[0] // dp
    return x[rank * rows:(rank + 1) * rows]


def local_batch(cfg: RunConfig, step: int, rank: int, device) -> tuple:
    """This rank's ``(inputs, targets)`` of global step ``step``, on ``device``, in a traced
    ``"data"`` region: :func:`labkit.models.data.make_batch` (the same global batch on every
    rank, shape ``[global_batch, ...]``) cut by :func:`local_rows` to
    ``[global_batch/dp, ...]``."""
    dp = cfg.parallel.dp
    with region("data"):
        x, y = make_batch(cfg, step)
        return local_rows(x, rank, dp).to(device), local_rows(y, rank, dp).to(device)


def run_steps(ctx, cfg: RunConfig, step_fn: Callable, model, opt, device,
              track: Iterable[torch.Tensor] = ()) -> tuple:
    """Run ``cfg.steps`` training steps, timing them and measuring memory in one of them.

    ``step_fn(s, mark)`` runs step ``s`` and returns its loss (a float); ``mark(label)``
    records a memory snapshot (a no-op outside the tracked step). ``ctx.tracer.step`` is set
    to ``s`` before each step. With ``cfg.measure_memory`` the last step runs under
    :func:`labkit.measure.memory.measure_memory` (``model``, ``opt``, ``device`` and the
    extra ``track`` tensors are what it tracks) and is not timed, unless it is the only step:
    then it is timed as well, tracker overhead and first-step allocation included.

    Returns:
        ``(losses, times, memory_report)``: ``losses[s]`` per step (every step),
        ``times`` in seconds from the tracer's clock (the untracked steps, in order), and the
        :class:`~labkit.measure.memory.MemoryReport` or ``None`` when memory is off.
    """
    losses, times, report = [], [], None
    mem_step = cfg.steps - 1 if cfg.measure_memory else None
    for s in range(cfg.steps):
        ctx.tracer.step = s
        if s == mem_step:
            holder: dict = {}
            t0 = ctx.tracer.now()
            report = measure_memory(lambda mark: holder.setdefault("loss", step_fn(s, mark)),
                                    model, opt, device, track=track)
            losses.append(holder["loss"])
            if cfg.steps == 1:
                times.append(ctx.tracer.now() - t0)
            continue
        t0 = ctx.tracer.now()
        losses.append(step_fn(s, lambda label: None))
        times.append(ctx.tracer.now() - t0)
    return losses, times, report


def steady_step_time(times: Sequence[float]) -> float:
    """Median step time (s) of the steady steps: ``times[1:]`` (the first step pays lazy
    allocation of Adam state), or ``times`` when there is only one; NaN when empty."""
    steady = list(times[1:] or times)
    return statistics.median(steady) if steady else float("nan")


def run(ctx, cfg: RunConfig) -> dict:
    """Train ``cfg`` on this rank; returns ``{"losses", "metrics"[, "state"]}`` (plain data).

    ``losses[s]`` is this rank's mean loss over its rows of step ``s``; the mean over ranks
    is the global-batch loss. ``metrics`` holds step time, memory by category (measured and
    predicted, bytes), FLOPs per step (counted and analytic), peak FLOP/s, MFU/HFU, and
    communication bytes per step (measured and predicted).
    """
    cfg.validate(ctx.world_size)
    dp, rank, device = cfg.parallel.dp, ctx.rank, ctx.device
    mc = cfg.model_config
    model = build_model(mc, device=device, seed=cfg.seed)
    _checkpoint(model, cfg)
    n_params = sum(p.numel() for _, p in unique_parameters(model))
    if cfg.dp_mode == "torch":
        wrapped = torch_ddp(model, ctx.group, cfg.bucket_mb, cfg.find_unused)
    else:
        wrapped = DataParallel(model, ctx.group, cfg.dp_mode, cfg.bucket_mb, cfg.find_unused)
    opt = _optimizer(model, cfg)
    micro, accum = cfg.micro, cfg.accum_steps

    def step(s: int, mark) -> float:
        x, y = local_batch(cfg, s, rank, device)
        total = 0.0
        for m in range(accum):
            sync = contextlib.nullcontext() if m == accum - 1 else wrapped.no_sync()
            with sync:
                with region("forward", micro=m):
                    loss = wrapped(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro])
                    loss = loss / accum
                mark(f"forward {m}")
                with region("backward", micro=m):
                    loss.backward()
                mark(f"backward {m}")
            total += loss.item()
        if isinstance(wrapped, DataParallel):
            with region("grad_sync"):
                wrapped.finish_gradient_sync()
        with region("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        mark("optimizer")
        return total

    losses, times, report = run_steps(ctx, cfg, step, model, opt, device)
    step_time = steady_step_time(times)
    timed_step = 1 if len(times) > 1 else 0

    metrics = {
        "rank": rank, "dp": dp, "micro_batch": micro, "accum_steps": accum,
        "dp_mode": cfg.dp_mode, "bucket_mb": cfg.bucket_mb, "model": mc.name,
        "n_params": n_params, "tokens_per_step": cfg.global_batch * mc.seq_len,
        "step_time_s": step_time, "step_times": times, "checkpoint": cfg.checkpoint,
        "bucket_bytes": getattr(wrapped, "bucket_bytes", 0),
    }
    elem = next(model.parameters()).element_size()
    metrics["memory_predicted"] = {k: int(v) for k, v in model_state_bytes(
        n_params, 1, 0, mixed_precision=False).items()}
    if report is not None:
        metrics["memory"] = _memory_metrics(report, metrics["bucket_bytes"])
    metrics["comm_bytes_per_step"] = ctx.tracer and sum(
        e.bytes_sent for e in ctx.tracer.events if e.step == timed_step and e.cat == "comm")
    metrics["comm_bytes_predicted"] = dp_step_comm_bytes(n_params, dp, elem)
    metrics.update(flops_and_mfu(ctx, cfg, model, step_time, accum))
    out = {"losses": losses, "metrics": metrics}
    if cfg.return_state and rank == 0:
        out["state"] = flat_params(model)
    return out


def _memory_metrics(report, bucket_bytes: int) -> dict:
    """Plain-data memory metrics. DDP bucket buffers exist before the tracked step, so the
    tracker cannot see them; they are added to "other" by their known size.

    ``model_state`` is each model-state category's largest value during the step (gradients
    exist only between backward and ``zero_grad``, so the breakdown at the moment of peak
    total can show none): the numbers to hold against ``labkit.plan``.
    """
    peak = dict(report.peak)
    peak["other"] = peak.get("other", 0) + bucket_bytes
    snaps = [dict(v) for _, v in report.timeline] + [dict(report.peak)]
    model_state = {c: max(s.get(c, 0) for s in snaps)
                   for c in ("parameters", "gradients", "optimizer")}
    return {"peak": peak, "peak_total": report.peak_total + bucket_bytes,
            "model_state": model_state,
            "timeline": [[lbl, dict(v)] for lbl, v in report.timeline],
            "allocator_peak": report.allocator_peak}


def _checkpoint(model, cfg: RunConfig) -> None:
    if cfg.checkpoint != "none":
        from ..parallel.checkpoint.policy import apply_checkpoint_policy

        apply_checkpoint_policy(model, cfg.checkpoint, cfg.checkpoint_every)


def _count(ctx, cfg: RunConfig, policy: bool) -> int:
    """FLOPs of one microbatch's forward+backward on a fresh copy of the model, with or
    without the checkpoint policy (cached per shape): model FLOPs vs hardware FLOPs."""
    mc = cfg.model_config
    key = ("flops", mc, cfg.micro, str(ctx.device), cfg.checkpoint if policy else "none",
           cfg.checkpoint_every)
    if key not in ctx.cache:
        ref = build_model(mc, device=ctx.device, seed=cfg.seed)
        if policy:
            _checkpoint(ref, cfg)
        x, y = make_batch(cfg.replace(global_batch=cfg.micro, parallel=cfg.parallel.__class__()), 0)
        ctx.cache[key] = count_flops(lambda: ref(x.to(ctx.device), y.to(ctx.device)).backward()).total
    return ctx.cache[key]


def flops_and_mfu(ctx, cfg: RunConfig, model, step_time: float, accum: int) -> dict:
    """FLOPs per step and MFU/HFU of this rank, as plain data.

    Args:
        ctx: the rank context (``cache`` memoizes FLOP counts and the measured peak).
        cfg: the run (model, micro-batch, local batch, checkpoint policy, ``count_flops``).
        model: the trained model; its parameter dtype picks the peak to divide by.
        step_time: seconds per optimizer step (e.g. :func:`steady_step_time`).
        accum: microbatches per step (``cfg.accum_steps``).

    Returns:
        ``{"flops_analytic"`` (6·N + attention per token × local tokens, GPT only, else
        ``None``), ``"flops_per_step"`` (torch's counter × ``accum``), ``"hardware_flops_per_step"``
        (with recomputation), ``"peak_flops"`` (FLOP/s of this device, or the calibrated CPU
        share), ``"mfu"``, ``"hfu"`` (fractions)``}``; all but ``flops_analytic`` are
        ``None`` when ``cfg.count_flops`` is off or no peak is known.
    """
    mc = cfg.model_config
    out: dict = {"flops_per_step": None, "hardware_flops_per_step": None, "peak_flops": None,
                 "mfu": None, "hfu": None}
    tokens_local = cfg.local_batch * mc.seq_len
    analytic = None
    if mc.kind == "gpt":
        analytic = transformer_flops_per_token(mc, causal=True)["total"] * tokens_local
    out["flops_analytic"] = analytic
    if not cfg.count_flops:
        return out
    flops = _count(ctx, cfg, policy=False) * accum
    hw_flops = _count(ctx, cfg, policy=True) * accum if cfg.checkpoint != "none" else flops
    out["flops_per_step"], out["hardware_flops_per_step"] = float(flops), float(hw_flops)
    dtype = next(model.parameters()).dtype  # divide by the peak of the dtype that ran
    peak = rank_peak_flops(ctx, dtype)
    if peak and not ctx.is_cuda and ctx.world_size == 1 and hw_flops / step_time > peak:
        # faster than the ceiling: the calibration was disturbed (it can only read low).
        # Measure again; the cache keeps the larger value. (With several ranks the
        # calibration must run on all of them at once, so only a lone rank re-measures.)
        peak = ctx.cache[("peak", str(ctx.device), 1, torch.float32)] = calibrate_cpu_peak(
            refresh=True)
    out["peak_flops"] = peak
    if peak:
        rep = mfu_report(flops, step_time, peak, 1, hardware_flops_per_step=hw_flops)
        out["mfu"], out["hfu"] = rep.mfu, rep.hfu
    return out


def reference(cfg: RunConfig, device: str = "cpu") -> dict:
    """Single-process training on the same global batches: ``{"losses", "state"}``.

    No communication, no wrapper, no checkpointing: the ground truth every parallel (and
    recomputing) run must match.
    """
    mc = cfg.model_config
    model = build_model(mc, device=device, seed=cfg.seed)
    opt = _optimizer(model, cfg)
    losses = []
    for s in range(cfg.steps):
        x, y = make_batch(cfg, s)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": flat_params(model)}
