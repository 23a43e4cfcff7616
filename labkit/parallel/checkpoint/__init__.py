"""Activation checkpointing (claims C17, C18), one concept per module:

* :mod:`.schedule` — schedules as data, closed-form counts and a pure simulator (no torch);
* :mod:`.exec` — a schedule executed on a real layer stack, its counts measured;
* :mod:`.policy` — ``torch.utils.checkpoint`` policies on labkit's GPT (none, full, every,
  selective), what the training job applies;
* :mod:`.jobs` — per-layer activation bytes against Korthikanti et al.'s formula and a
  policy's measured memory, FLOPs, MFU and HFU.

The schedule names are imported here; the torch-using modules load when first used.
"""
from .schedule import (BIG_O, STRATEGIES, Action, Counts, Schedule, SimResult, SimStep,
                       check_every, formula_counts, make_schedule, simulate, sqrt_every)

__all__ = ["STRATEGIES", "BIG_O", "Action", "Schedule", "Counts", "SimStep", "SimResult",
           "make_schedule", "formula_counts", "simulate", "sqrt_every", "check_every",
           "run_schedule", "ExecResult", "ChainStack", "SavedTensorTracker",
           "apply_checkpoint_policy", "POLICIES", "keep_matmuls_policy"]

_LAZY = {"run_schedule": "exec", "ExecResult": "exec", "ChainStack": "exec",
         "SavedTensorTracker": "exec", "apply_checkpoint_policy": "policy",
         "POLICIES": "policy", "keep_matmuls_policy": "policy"}


def __getattr__(name: str):  # the executor and policies import torch; the schedules do not
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
