"""Frozen configuration: the model's shape (:class:`ModelConfig`, from
:mod:`labkit.model_config`) and one training run
(:class:`RunConfig`: the model, the batch, every parallel degree and its knobs).

Every config is a frozen dataclass (picklable, hashable) so it can cross into rank
processes and be compared between runs. ``RunConfig.validate(world_size)`` raises
``ValueError`` naming the field and the numbers *before* any process is touched; its rules
live in :mod:`labkit.validate`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .model_config import COUNT_ONLY, PRESETS, ModelConfig, preset

__all__ = ["ModelConfig", "ParallelConfig", "RunConfig", "PRESETS", "preset", "COUNT_ONLY"]


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each parallelism. ``dp·tp·pp·cp`` ranks run the job; ``ep`` (expert
    parallelism) is a second view over the ``dp·cp`` ranks and adds none."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def validate(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class RunConfig:
    """One training job: what to train, how to split it over the mesh, what to measure.

    The job (:func:`labkit.jobs.train`) composes, in this order: pipeline split (``pp``) →
    tensor (``tp``) → context (``cp``) → expert (``ep``) parallelism → activation
    checkpointing → data parallelism / ZeRO / FSDP / HSDP over the data ranks → AdamW.
    Every field either takes effect in that composition or is refused by :meth:`validate`.

    Attributes:
        model: a preset name or a ``ModelConfig``.
        parallel: the degrees (``dp``, ``tp``, ``pp``, ``cp``, ``ep``).
        steps: optimizer steps. global_batch: samples per step over all ranks.
        micro_batch: samples per forward/backward on one data-parallel rank; ``None`` is
            the whole local batch (``global_batch / dp``) without a pipeline; with one,
            ``local / microbatches`` when ``microbatches`` is set, else ``local/M`` for the
            largest ``M <= 2·pp`` dividing the local batch.
        lr, weight_decay, adam_eps: AdamW's (``lr`` > 0, ``weight_decay`` >= 0, ``eps`` > 0;
            PyTorch's default ``1e-8``). A parameter whose gradient is near zero moves by up
            to ``lr`` when its gradient changes sign in the last bit, so parity checks after
            several steps use a larger ``eps`` (``1e-6``).
        seed: model initialisation and data order; equal seeds give equal runs.
        dataset: ``"text"`` (GPT) or ``"digits"`` (ViT).
        zero_stage: 0 plain data parallelism, 1 optimizer state sharded, 2 + gradients,
            3 + parameters (FSDP) — Rajbhandari et al. 2020, §5.1.
        hsdp_replicas: ``M`` HSDP replica groups of ``dp/M`` shards (ZeRO 1–3; Zhao et al.
            2023 §3.2.2); 1 is plain ZeRO over all data ranks.
        prefetch: ZeRO-3: issue the next unit's all-gather before computing the current one.
        keep_last: ZeRO-3: keep the root unit gathered across the forward→backward turn.
        dp_mode: ZeRO 0: ``"ddp"`` (bucketed, overlapped all-reduce) or ``"naive"`` (one
            all-reduce per parameter after backward).
        bucket_mb: ``"ddp"`` bucket capacity in MiB (PyTorch's default is 25).
        find_unused: ZeRO 0: a rank that got no gradient for a parameter contributes
            zeros instead of raising, and a parameter no rank used keeps ``grad=None`` (torch
            DDP's ``find_unused_parameters``). ZeRO units always reduce zeros instead: a
            flat unit has one gradient for all its parameters, so AdamW's decay still moves
            a parameter no rank used.
        schedule: pipeline schedule (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``,
            ``zb-v``, ``dualpipe-v``) when ``pp > 1``.
        microbatches: microbatches per pipeline flush (``pp > 1``); ``None`` runs all of a
            step's microbatches in one flush, else the step runs several flushes.
        virtual_stages: stages per pipeline rank ``V`` (``None``: what the schedule needs).
        sequence_parallel: with ``tp > 1``, norms on ``S/tp`` tokens and all-gather /
            reduce-scatter instead of all-reduce (Korthikanti et al. 2022).
        cp_method: with ``cp > 1``: ``"ring"``, ``"ulysses"`` or ``"allgather"``.
        cp_zigzag: with ``cp > 1``: balance causal work with the zigzag split.
        checkpoint: activation checkpointing of the blocks: ``"none"``, ``"full"``,
            ``"every"`` (segments of ``checkpoint_every`` blocks) or ``"selective"``.
        checkpoint_every: blocks per segment for ``checkpoint="every"`` (1 with ZeRO-3
            over several data ranks: each unit gathers only its own block's parameters).
        precision: ``"fp32"`` or ``"bf16"`` (bf16 compute, fp32 master weights and Adam
            state: 16 bytes per parameter with ZeRO's bf16 parameters and gradients).
        compile: ``torch.compile`` each transformer block.
        impl: ``"labkit"`` or ``"torch"``: PyTorch's own counterpart of the one parallelism
            in use (DDP, FSDP2 ``fully_shard``, ``torch.distributed.pipelining``), the
            parity and speed reference; refused with ``ep > 1``.
        measure_memory: track memory by category in the last step.
        count_flops: count FLOPs with torch's counter (cached per shape) for MFU.
        timeout_s: seconds before a hung job is cancelled.
        return_state: every rank returns the full fp32 parameters by name.
        return_grads: every rank returns the first step's full gradients by name.
        fault: faults to inject (:mod:`labkit.faults.spec`): ``"kill@3:rank1"``,
            ``"hang@2:rank0"``, ``"skip@1:rank1"``, ``"slow@0:rank3:seconds=0.3"``,
            ``"bitflip@2:rank1:target=grad"``, several joined by ``,``, or
            :class:`~labkit.faults.FaultSpec` s; checked by :meth:`validate`.
        watchdog_s: seconds a rank may wait inside one collective before the cluster
            declares a hang, names the rank and the collective
            (:class:`~labkit.faults.watch.CollectiveHang`) and restarts; ``None``: only
            ``timeout_s`` ends a hung job.
        straggler_s: while the job runs, the cluster reports (without stopping it) a rank
            that entered 3 of its group's last 4 collectives last, more than this many
            seconds after the others (:func:`labkit.faults.straggler.live_stragglers`);
            ``None`` (default): off.
        fingerprint_every: every this many steps, data-parallel replicas all-gather a
            checksum of their reduced gradients and parameters and compare (silent data
            corruption, :mod:`labkit.faults.sdc`); 0 (default) is off.
        save_dir: folder for snapshots of the whole training state (:mod:`labkit.snapshot`:
            parameters and AdamW state in their shards, step, RNG) written with
            ``torch.distributed.checkpoint``; ``None`` saves nothing. Not activation
            checkpointing (``checkpoint``). The run creates this folder if it is missing,
            but not its parent: a parent that does not exist is refused (as ``labkit run
            --trace`` refuses a file in a missing folder).
        save_every: with ``save_dir``, a snapshot after every ``save_every`` steps (``0``:
            only after the last step, which is always saved).
        resume: ``True`` continues from the latest complete snapshot in ``save_dir``; a
            path, from that snapshot (or the latest in that folder). Any valid layout of
            the same model loads it (resharded); ``steps`` still counts from the run's start.
        noise_scale: measure the gradient noise scale ``B_simple`` (the critical batch
            size) from each rank's local gradient before the data-parallel reduction and
            the reduced one after it (McCandlish et al. 2018, A.1); per step in
            ``metrics["noise_scale"]`` (:mod:`labkit.train.noise_scale`). Needs dp > 1 at
            zero_stage 0 or 1 (no HSDP) with impl='labkit', tp = pp = cp = 1 and a dense model.
    """

    model: ModelConfig | str = "tiny"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    steps: int = 3
    global_batch: int = 8
    micro_batch: Optional[int] = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    seed: int = 0
    dataset: str = "text"
    zero_stage: int = 0
    hsdp_replicas: int = 1
    prefetch: bool = True
    keep_last: bool = True
    dp_mode: str = "ddp"
    bucket_mb: float = 25.0
    find_unused: bool = False
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: Optional[int] = None
    sequence_parallel: bool = False
    cp_method: str = "ring"
    cp_zigzag: bool = True
    checkpoint: str = "none"
    checkpoint_every: int = 1
    precision: str = "fp32"
    compile: bool = False
    impl: str = "labkit"
    measure_memory: bool = True
    count_flops: bool = True
    timeout_s: float = 120.0
    return_state: bool = False
    return_grads: bool = False
    fault: Any = None
    watchdog_s: Optional[float] = None
    straggler_s: Optional[float] = None
    fingerprint_every: int = 0
    save_dir: Optional[str] = None
    save_every: int = 0
    resume: bool | str = False
    noise_scale: bool = False

    # -- derived -------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return preset(self.model) if isinstance(self.model, str) else self.model

    @property
    def planning_only(self) -> bool:
        """True for a preset too large to build on one machine (planning and counting)."""
        return isinstance(self.model, str) and self.model in COUNT_ONLY

    @property
    def faults(self) -> tuple:
        """``fault`` as a tuple of :class:`~labkit.faults.FaultSpec` (empty: none).

        Raises:
            ValueError: ``fault`` is not of the form ``KIND@STEP:rankR[:key=value…]``.
        """
        from .faults.spec import parse_faults

        try:
            return parse_faults(self.fault)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"fault={self.fault!r}: {exc}") from None

    @property
    def local_batch(self) -> int:
        """Samples per step on one data-parallel rank."""
        return self.global_batch // self.parallel.dp

    @property
    def micro(self) -> int:
        """Samples per microbatch on one data-parallel rank."""
        if self.micro_batch is not None:
            return self.micro_batch
        local = max(1, self.local_batch)
        if self.parallel.pp == 1:
            return local
        if self.microbatches:  # one flush of that many microbatches
            return max(1, local // self.microbatches)
        m = max(d for d in range(1, min(local, 2 * self.parallel.pp) + 1) if local % d == 0)
        return local // m

    @property
    def accum_steps(self) -> int:
        """Microbatches per step on one data-parallel rank."""
        return self.local_batch // self.micro

    @property
    def flush_microbatches(self) -> int:
        """``M``: microbatches per pipeline flush."""
        return self.microbatches or self.accum_steps

    @property
    def flushes(self) -> int:
        """Pipeline flushes per step (gradient accumulation across flushes)."""
        return self.accum_steps // self.flush_microbatches

    @property
    def stages_per_rank(self) -> int:
        """``V``: pipeline stages per rank."""
        from .parallel.pipeline.schedules import STAGES_PER_RANK

        return self.virtual_stages or STAGES_PER_RANK.get(self.schedule) or 2

    @property
    def n_stages(self) -> int:
        return self.parallel.pp * self.stages_per_rank if self.parallel.pp > 1 else 1

    @property
    def mesh(self):
        """The :class:`~labkit.mesh.Mesh`: ``dp`` is ``dp_replicate`` (plain data
        parallelism) at ZeRO 0, and ``hsdp_replicas × dp/hsdp_replicas`` above."""
        from .mesh import Mesh

        p = self.parallel
        repl = p.dp if self.zero_stage == 0 else self.hsdp_replicas
        return Mesh(pp=p.pp, dp_replicate=repl, dp_shard=p.dp // repl, cp=p.cp, tp=p.tp,
                    ep=p.ep)

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch: the denominator of every rank's loss."""
        return self.global_batch * self.model_config.seq_len

    def build_schedule(self):
        """The pipeline :class:`~labkit.parallel.pipeline.schedules.Schedule` of one flush."""
        from .parallel.pipeline.schedules import build

        return build(self.schedule, self.parallel.pp, self.flush_microbatches,
                     self.stages_per_rank)

    def __post_init__(self):
        # ``parallel=dict(dp=2, tp=2)`` is the short form; the stored value is always a
        # ParallelConfig so that it stays frozen and hashable
        if isinstance(self.parallel, dict):
            object.__setattr__(self, "parallel", ParallelConfig(**self.parallel))
        if isinstance(self.fault, list):  # frozen and hashable: a tuple
            object.__setattr__(self, "fault", tuple(self.fault))

    def replace(self, **changes) -> "RunConfig":
        """Copy with ``changes``; ``dp=``, ``tp=``, ``pp=``, ``cp=``, ``ep=`` go to
        ``parallel``; ``parallel=dict(...)`` replaces all the degrees (unnamed ones are 1)."""
        par = {k: changes.pop(k) for k in list(changes) if k in _PARALLEL_FIELDS}
        if isinstance(changes.get("parallel"), dict):
            changes["parallel"] = ParallelConfig(**changes["parallel"])
        if par:
            changes["parallel"] = replace(changes.get("parallel", self.parallel), **par)
        return replace(self, **changes)

    def validate(self, world_size: Optional[int] = None) -> "RunConfig":
        """Check that this job can run on ``world_size`` ranks; return ``self``.

        Raises:
            labkit.ConfigError: a ``ValueError`` naming the field and the numbers (see
                :mod:`labkit.validate`); a notebook shows its sentence without a traceback.
        """
        from .validate import validate_run

        validate_run(self, world_size)
        return self


_PARALLEL_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)}
