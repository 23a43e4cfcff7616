"""labkit: a Jupyter-first lab for large-scale distributed training.

The public names are re-exported lazily so that ``import labkit`` stays cheap in rank
processes and in the notebook kernel.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Cluster": "labkit.cluster",
    "RunResult": "labkit.result",
    "RankError": "labkit.result",
    "JobCancelled": "labkit.result",
    "Trace": "labkit.trace",
    "Event": "labkit.trace",
    "ConfigError": "labkit.validate",
    "RunConfig": "labkit.config",
    "ModelConfig": "labkit.config",
    "ParallelConfig": "labkit.config",
    "preset": "labkit.config",
}
_SUBMODULES = {"jobs", "comm", "measure", "plan", "models", "parallel", "config", "trace",
               "cluster", "collectives"}

__all__ = sorted(_LAZY) + sorted(_SUBMODULES)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


def __dir__() -> list:
    # the lazy names must show up in dir() and in a notebook's tab completion
    return sorted(set(globals()) | set(__all__))
