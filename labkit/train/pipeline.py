"""The pipeline side of the training job: the executor over this rank's pipeline group,
activation metering, and the one-way message time the bubble report adds per hop."""
from __future__ import annotations

import torch

from .. import comm
from ..parallel.pipeline.executor import PipelineExecutor
from ..parallel.pipeline.stage import ActivationMeter

__all__ = ["make_executor", "meter_untracked_steps", "TorchPipeline", "p2p_latency",
           "boundary_shape"]

#: labkit's schedule names → torch.distributed.pipelining's classes
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble",
                   "dualpipe-v": "ScheduleDualPipeV"}


def boundary_shape(cfg) -> tuple:
    """``(micro_batch, S/cp, H)``, or ``(micro_batch, S/(cp·tp), H)`` with sequence
    parallelism: the activation (and its gradient) crossing a stage boundary, this rank's
    share of the residual stream."""
    mc = cfg.model_config
    seq = mc.seq_len // cfg.parallel.cp
    if cfg.sequence_parallel:
        seq //= cfg.parallel.tp
    return (cfg.micro, seq, mc.d_model)


def make_executor(setup) -> tuple:
    """``(executor, meter)`` for this rank's stages: peers addressed by global rank through
    the ``pp`` group; each stage's forward runs through its data-parallel wrapper; the loss
    is the sum over tokens (scaled by the step's ``1/tokens_per_step``)."""
    cfg, mg = setup.cfg, setup.mg
    flats = [u.flat for w in setup.sharded for u in getattr(w, "units", [])]
    meter = ActivationMeter(list(setup.stages.values()), enabled=cfg.measure_memory,
                            weights=tuple(flats))
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    ex = PipelineExecutor(setup.schedule, setup.stages, mg.index("pp"), mg.group("pp"),
                          boundary_shape(cfg), dtype if setup.sharded else torch.float32,
                          setup.device, setup.store, meter, pp_ranks=mg.ranks("pp"),
                          forward_fns=setup.forward, loss_reduction="sum")
    return ex, meter


def meter_untracked_steps(step, meter, cfg):
    """``step`` with the activation meter off in the step the memory tracker runs (the
    last, when there are others): the tracker's backward hooks hold every stage input it
    saw until the step ends, so on the stages that receive their input every microbatch
    would look alive at once (1F1B at P=4, M=8 read [4, 8, 8, 8] instead of [4, 3, 2, 1])."""
    if not cfg.measure_memory or cfg.steps < 2:
        return step
    tracked = cfg.steps - 1

    def metered(s: int, mark):
        meter.enabled = s != tracked
        try:
            return step(s, mark)
        finally:
            meter.enabled = True

    return metered


def p2p_latency(ctx, setup, rounds: int = 16) -> float:
    """One-way seconds of one boundary tensor between the first two ranks of the first
    pipeline: half the fastest of ``rounds`` blocking ping-pongs through labkit.comm,
    untraced. Every rank of the job calls it; barriers on both sides keep the others from
    computing meanwhile (on a machine with fewer cores than ranks they would otherwise time
    the core sharing instead of the message). Returns 0.0 on every other rank."""
    mesh = setup.mg.mesh
    a, b = mesh.group(0, "pp")[:2]
    t = torch.zeros(boundary_shape(setup.cfg), device=ctx.device)
    enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
    rtts = []
    comm.barrier(ctx.group)
    try:
        for _ in range(rounds):
            if ctx.rank == a:
                t0 = ctx.tracer.now()
                comm.send(t, b, ctx.group)
                comm.recv(t, b, ctx.group)
                rtts.append(ctx.tracer.now() - t0)
            elif ctx.rank == b:
                comm.recv(t, a, ctx.group)
                comm.send(t, a, ctx.group)
        comm.barrier(ctx.group)
    finally:
        ctx.tracer.enabled = enabled
    return min(rtts[1:]) / 2 if rtts else 0.0


class TorchPipeline:
    """The same stages under ``torch.distributed.pipelining`` (``impl="torch"``): the parity
    and speed reference for labkit's executor. Its point-to-point traffic bypasses
    labkit.comm, so its trace holds compute only. ``run`` has the executor's signature.

    GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble (an untied model: with the embedding and
    head on one rank, torch 2.13's ZBV gets the shared weight's gradient wrong, so validate
    refuses it). For ZB-V the stages keep their plain linears: PyTorch splits the input and
    weight gradients itself."""

    def __init__(self, setup):
        from torch.distributed import pipelining as P

        cfg, mg = setup.cfg, setup.mg
        self.stages = setup.stages
        group = mg.group("pp")
        pstages = [P.PipelineStage(m, s, setup.schedule.n_stages, setup.device, group=group)
                   for s, m in sorted(setup.stages.items())]
        for ps, (_, m) in zip(pstages, sorted(setup.stages.items())):
            _unrecorded_shape_inference(ps, m)
        cls = getattr(P.schedules, TORCH_SCHEDULES[cfg.schedule])
        self.scale = 1.0
        self.last = [m for m in setup.stages.values() if m.is_last]
        self.first = any(m.is_first for m in setup.stages.values())
        loss_fn = lambda out, y: self.last[0].loss(out, y, "sum") * self.scale  # noqa: E731
        one = cls in (P.ScheduleGPipe, P.Schedule1F1B)
        self.schedule = cls(pstages[0] if one else pstages, n_microbatches=cfg.flush_microbatches,
                            loss_fn=loss_fn, scale_grads=False)

    def run(self, x: torch.Tensor, y: torch.Tensor, loss_scale: float, flush: int = 0) -> float:
        self.scale = loss_scale
        losses: list = []
        kw = {"target": y, "losses": losses} if self.last else {}
        if self.first:
            self.schedule.step(x, **kw)
        else:
            self.schedule.step(**kw)
        return torch.stack([t.detach() for t in losses]).sum().double() if losses \
            else torch.zeros((), dtype=torch.float64, device=x.device)


def _unrecorded_shape_inference(pstage, module) -> None:
    """On its first step torch 2.13's ``PipelineStage`` runs one extra forward of real
    tensors to learn its output shapes (``_forward_metadata_inference``). That forward is no
    training work: routing it into the MoE layers' log counted an extra microbatch into step
    0's expert loads. Run it with the routing log detached (a torch without that method
    keeps its own behaviour)."""
    from ..models.moe import moe_layers

    infer = getattr(pstage, "_forward_metadata_inference", None)
    layers = moe_layers(module)
    if infer is None or not layers:
        return

    def quiet(*args, **kwargs):
        logs = [m._log for m in layers]
        for m in layers:
            m._log = None
        try:
            return infer(*args, **kwargs)
        finally:
            for m, log in zip(layers, logs):
                m._log = log
    pstage._forward_metadata_inference = quiet

