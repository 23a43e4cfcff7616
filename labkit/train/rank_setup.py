"""What one rank trains with (:class:`RankSetup`): the stages it holds, the wrappers that run
and reduce them, the pipeline's schedule and tied-embedding exchange, and the optimizer —
filled in by :func:`labkit.train.build.build_rank`, read by the training step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ..mesh import MeshGroups


@dataclass
class RankSetup:
    """What one rank trains with.

    Attributes:
        stages: ``{stage id: module}`` this rank holds (``{0: model}`` without a pipeline).
        forward: ``{stage id: callable}`` that runs each stage (its data-parallel wrapper).
        wrappers: data-parallel wrappers, in the order their gradients are synchronised.
        sharded: wrappers with flat units (ZeRO 1–3): they own ``after_step``/``zero_grad``.
        schedule, store, tied: the pipeline schedule, zero-bubble weight-gradient store and
            tied-embedding exchange (``None`` without a pipeline).
        opt: AdamW over what this rank updates.
        n_params: the whole model's parameters; rank_params: this rank's stages' (unsharded).
        autocast: the context forward passes run in (bf16 autocast or nothing).
        track: tensors the memory tracker should count as this rank's working set.
        plain_params: the optimizer's parameters outside flat units (their ``.grad`` is
            cleared after each step; the units clear their own).
        reused: what a warm rank took from its cache instead of building
            (:mod:`labkit.train.cache`).
    """

    cfg: Any
    mg: MeshGroups
    device: Any
    stages: dict
    forward: dict
    wrappers: list = field(default_factory=list)
    sharded: list = field(default_factory=list)
    schedule: Any = None
    store: Any = None
    tied: Any = None
    opt: Any = None
    n_params: int = 0
    rank_params: int = 0
    autocast: Callable = None
    track: list = field(default_factory=list)
    plain_params: list = field(default_factory=list)
    cp_core: Any = None
    tp_info: Any = None
    expert_params: list = field(default_factory=list)
    reused: list = field(default_factory=list)

    @property
    def memory_module(self) -> nn.Module:
        """What the memory tracker walks: the wrappers that own flat units, else the stages."""
        if self.sharded:
            return nn.ModuleList(self.sharded + [m for m in self.stages.values()
                                                 if not any(w.module is m for w in self.sharded)])
        return nn.ModuleList(self.stages.values())

    def require_sync(self, on: bool) -> None:
        """Let the wrappers' backward hooks reduce (``True``) or only accumulate."""
        for w in self.wrappers:
            if hasattr(w, "require_backward_grad_sync"):  # PyTorch DDP's no_sync flag
                w.require_backward_grad_sync = on
            else:
                w.require_sync = on
