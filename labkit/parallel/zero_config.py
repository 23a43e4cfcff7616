"""``ZeroConfig``: a training run (:class:`labkit.config.RunConfig`) plus the ZeRO knobs.

Frozen and picklable, so it crosses into rank processes like a ``RunConfig``; it exposes
``parallel`` and ``timeout_s`` so :meth:`labkit.Cluster.run` sizes and times the job from it.

The data-parallel ranks ``N = run.parallel.dp`` form an HSDP mesh of ``M = hsdp_replicas``
replica groups × ``K = N / M`` shards (Zhao et al. 2023, "PyTorch FSDP", §3.2.2, hybrid
sharding). ``M = 1`` is plain ZeRO/FSDP over all ``N`` ranks; model state is divided by
``K``, the shard count.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from ..config import RunConfig

__all__ = ["ZeroConfig", "IMPLS"]

#: ``"labkit"``: labkit.parallel.zero/fsdp; ``"torch"``: PyTorch FSDP2 ``fully_shard``
#: (stage 3 only), the parity and speed reference.
IMPLS = ("labkit", "torch")


@dataclass(frozen=True)
class ZeroConfig:
    """One ZeRO / FSDP / HSDP training job.

    Attributes:
        run: model, batch, steps, ``parallel.dp`` (the ranks N) and what to measure.
        zero_stage: 0 plain DP (labkit's bucketed DP), 1 optimizer state sharded,
            2 + gradients, 3 + parameters (FSDP) — Rajbhandari et al. 2020, §5.1.
        prefetch: stage 3: issue the next unit's all-gather (async) before computing the
            current one, in forward and in backward.
        hsdp_replicas: ``M`` replica groups; each group of ``K = dp / M`` ranks shards the
            model state, gradients are then all-reduced across the groups.
        mixed_precision: bf16 parameters and gradients with fp32 master weights and Adam
            moments (2 + 2 + 12 = 16 bytes/param); ``False`` is fp32 everywhere (4 + 4 + 8).
        keep_last: stage 3: keep the unit that finishes forward last (the root unit:
            embedding, final norm, head) gathered across the forward→backward turn, as
            FSDP2 does for its root; saves its backward all-gather. ``False`` reshards it
            too, so the traffic is exactly the lecture's 3Ψ.
        impl: ``"labkit"`` or ``"torch"`` (PyTorch FSDP2, stage 3 only).
    """

    run: RunConfig = field(default_factory=RunConfig)
    zero_stage: int = 3
    prefetch: bool = True
    hsdp_replicas: int = 1
    mixed_precision: bool = False
    keep_last: bool = True
    impl: str = "labkit"

    @property
    def parallel(self):
        return self.run.parallel

    @property
    def timeout_s(self) -> float:
        return self.run.timeout_s

    @property
    def dp(self) -> int:
        return self.run.parallel.dp

    @property
    def shards(self) -> int:
        """``K``: ranks sharing one copy of the model state (``dp / hsdp_replicas``)."""
        return self.run.parallel.dp // max(1, self.hsdp_replicas)

    def replace(self, **changes) -> "ZeroConfig":
        """Copy with ``changes``; names that are not ZeroConfig fields go to ``run``
        (``steps=``, ``dp=`` …)."""
        own = {k: changes.pop(k) for k in list(changes) if k in _FIELDS}
        if changes:
            own["run"] = own.get("run", self.run).replace(**changes)
        return replace(self, **own)

    def validate(self, world_size: Optional[int] = None) -> "ZeroConfig":
        """Check before launch; return ``self``.

        Raises:
            ValueError: naming the numbers: a stage outside 0–3; an HSDP group size
                (``hsdp_replicas``) that does not divide the data-parallel ranks; a shard
                count that does not divide the world size; tensor/pipeline/context degrees
                other than 1; FSDP2 (``impl="torch"``) with a stage other than 3; anything
                ``RunConfig.validate`` rejects.
        """
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        m = self.hsdp_replicas
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"hsdp_replicas must be a positive int, got {m!r}")
        dp = self.run.parallel.dp
        if dp % m:
            raise ValueError(f"HSDP replica groups hsdp_replicas={m} do not divide the "
                             f"data-parallel ranks dp={dp} (group size would be {dp}/{m})")
        k = dp // m
        if world_size is not None and world_size % k:
            raise ValueError(f"shard count K = dp/hsdp_replicas = {dp}/{m} = {k} does not "
                             f"divide the world size {world_size}")
        if world_size is not None and dp > world_size:
            raise ValueError(f"dp={dp} ranks requested but the cluster has world_size="
                             f"{world_size}")
        p = self.run.parallel
        if (p.tp, p.pp, p.cp) != (1, 1, 1):
            raise ValueError(f"ZeRO jobs shard over data-parallel ranks only: tp={p.tp}, "
                             f"pp={p.pp}, cp={p.cp} must all be 1")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.impl == "torch" and self.zero_stage != 3:
            raise ValueError(f"impl='torch' is PyTorch FSDP2 (ZeRO stage 3), got "
                             f"zero_stage={self.zero_stage}")
        if m > 1 and self.zero_stage == 0:
            raise ValueError(f"hsdp_replicas={m} needs zero_stage 1-3 (stage 0 is plain DP "
                             "over all ranks)")
        if self.mixed_precision and self.zero_stage == 0:
            raise ValueError("mixed_precision needs zero_stage 1-3 (stage 0 is labkit's "
                             "fp32 DataParallel)")
        self.run.validate(world_size)
        return self


_FIELDS = {"run", "zero_stage", "prefetch", "hsdp_replicas", "mixed_precision", "keep_last",
           "impl"}
