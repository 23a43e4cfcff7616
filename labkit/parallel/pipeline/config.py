"""``PipelineConfig``: one pipeline-parallel training job, validated before launch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from ...config import ModelConfig, ParallelConfig, check_optimizer_and_timeout, preset
from .presets import PP_BALANCED, PP_TINY
from .schedules import SCHEDULES, STAGES_PER_RANK, build

__all__ = ["PipelineConfig", "PP_TINY", "PP_BALANCED"]


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline-parallel run: the model cut into ``pp · V`` stages over ``pp`` ranks.

    Attributes:
        model: a preset name or ``ModelConfig``; ``n_layers`` (if set) overrides its depth.
        pp: pipeline ranks ``P``. microbatches: ``M`` per pipeline flush.
        schedule: a key of :data:`~labkit.parallel.pipeline.schedules.SCHEDULES`.
        virtual_stages: stages per rank ``V``; ``None`` = what the schedule needs (1; 2 for
            ``interleaved`` and ``zb-v``).
        global_batch: samples per optimizer step = ``accum_steps · M · micro-batch``.
        accum_steps: pipeline flushes per optimizer step (gradient accumulation).
        steps: optimizer steps; the bubble report skips step 0 (allocation, warm-up).
        lr, weight_decay: AdamW's; ``lr`` > 0, ``weight_decay`` >= 0.
        seed: model initialisation and data order (>= 0); equal seeds give equal runs.
        impl: ``"labkit"`` (this package's executor) or ``"torch"``
            (``torch.distributed.pipelining``; ``gpipe`` and ``1f1b`` only).
        measure_memory: count saved activation bytes per stage-microbatch (saved-tensor
            hooks) and report the peak per rank.
        return_grads: every rank returns its first step's gradients by full-model name.
        return_state: every rank returns its final parameters by full-model name.
        timeout_s: seconds before the cluster cancels the job (> 0).
    """

    model: Union[ModelConfig, str] = PP_TINY
    pp: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None
    n_layers: Optional[int] = None
    global_batch: int = 8
    accum_steps: int = 1
    steps: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    impl: str = "labkit"
    measure_memory: bool = True
    return_grads: bool = False
    return_state: bool = False
    timeout_s: float = 120.0

    @property
    def model_config(self) -> ModelConfig:
        mc = preset(self.model) if isinstance(self.model, str) else self.model
        return mc if self.n_layers is None else replace(mc, n_layers=self.n_layers)

    @property
    def stages_per_rank(self) -> int:
        return self.virtual_stages or STAGES_PER_RANK.get(self.schedule) or 2

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def micro(self) -> int:
        """Samples per microbatch."""
        return self.global_batch // (self.microbatches * self.accum_steps)

    @property
    def parallel(self) -> ParallelConfig:
        """The degrees, so ``Cluster.run`` starts ``pp`` ranks."""
        return ParallelConfig(pp=self.pp)

    def replace(self, **changes) -> "PipelineConfig":
        return replace(self, **changes)

    def build_schedule(self):
        """The :class:`~labkit.parallel.pipeline.schedules.Schedule` this run executes."""
        return build(self.schedule, self.pp, self.microbatches, self.stages_per_rank)

    def validate(self, world_size: Optional[int] = None) -> "PipelineConfig":
        """Check the run can work; return ``self``.

        Raises:
            ValueError: naming the numbers — an unknown schedule, a batch that does not
                split into the microbatches, more stages than layers, ``V`` not dividing the
                layers per rank, ``pp`` above the cluster's ranks, a bad ``impl``.
        """
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; known schedules: "
                             f"{', '.join(SCHEDULES)}")
        for name in ("pp", "microbatches", "accum_steps", "steps", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.n_layers is not None and (not isinstance(self.n_layers, int)
                                          or self.n_layers < 1):
            raise ValueError(f"n_layers must be a positive int, got {self.n_layers!r}")
        if self.virtual_stages is not None and self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        mc = self.model_config
        mc.validate()
        if mc.kind != "gpt":
            raise ValueError(f"pipeline parallelism here cuts the GPT; got model kind {mc.kind!r}")
        if world_size is not None and self.pp > world_size:
            raise ValueError(f"pp={self.pp} needs {self.pp} ranks but the cluster has "
                             f"world_size={world_size}")
        per_flush = self.microbatches * self.accum_steps
        if self.global_batch % per_flush:
            raise ValueError(f"global_batch={self.global_batch} does not split into "
                             f"microbatches={self.microbatches} x accum_steps="
                             f"{self.accum_steps} = {per_flush} equal microbatches")
        v, layers = self.stages_per_rank, mc.n_layers
        if self.n_stages > layers:
            raise ValueError(f"pp x virtual_stages = {self.pp} x {v} = {self.n_stages} stages "
                             f"but the model has n_layers={layers}: more stages than layers")
        if layers % self.pp:
            raise ValueError(f"n_layers={layers} does not split evenly over pp={self.pp} ranks")
        if (layers // self.pp) % v:
            raise ValueError(f"virtual_stages={v} does not divide the {layers // self.pp} "
                             f"layers per rank (n_layers={layers} / pp={self.pp})")
        if self.impl not in ("labkit", "torch"):
            raise ValueError(f"impl must be 'labkit' or 'torch', got {self.impl!r}")
        if self.impl == "torch" and self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"impl='torch' runs 'gpipe' or '1f1b', got {self.schedule!r}")
        check_optimizer_and_timeout(self)
        self.build_schedule()  # schedule-specific limits (e.g. interleaved M vs P)
        return self
