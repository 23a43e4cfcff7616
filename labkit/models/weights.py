"""Where a model's weights are built and how they are first drawn: layers on ``meta`` (or on
the target under fake tensors), a partial build of only some blocks (fake or meta tensors
only), and the Normal(0, 0.02) initialisation that makes the weights a pure function of the
RNG state (GPT-2 / Llama reference initialisation).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from .moe import Experts
from .norm import RMSNorm


INIT_STD = 0.02  # GPT-2 / Llama reference initialisation


def _target_device(device) -> torch.device:
    """Where a model should end up: ``device``, else the ambient default device.

    Models build their layers on ``meta`` and then ``to_empty`` onto this device before
    ``reset_parameters``: PyTorch's per-layer default inits never run, so the weights are a
    pure function of the RNG state at ``reset_parameters`` (a meta build followed by
    ``to_empty`` + ``reset_parameters`` gives the same weights), and nothing is drawn twice.
    """
    return torch.device(device) if device is not None else torch.get_default_device()


def _build_device(target: torch.device) -> torch.device:
    """Where layers are first built: ``meta`` (see :func:`_target_device`), or ``target``
    itself under a ``FakeTensorMode``, which allocates nothing anyway and cannot move its
    fake parameters with ``to_empty`` (it keeps weak references to them, so
    ``torch.utils.swap_tensors`` refuses; torch 2.13)."""
    from torch._guards import detect_fake_mode

    return target if detect_fake_mode() is not None else torch.device("meta")


class NotBuilt(nn.Module):
    """The slot of block ``index`` in a GPT built with ``layers=`` that leave it out: no
    parameters, and it refuses to run."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.index} was not built (GPT(layers=...) builds part "
                           "of a model for measuring one pipeline stage)")


def _kept_layers(n_layers: int, layers: Optional[Iterable[int]], target: torch.device
                 ) -> range | frozenset:
    if layers is None:
        return range(n_layers)
    from torch._guards import detect_fake_mode

    keep = frozenset(layers)
    bad = sorted(i for i in keep if isinstance(i, bool) or not isinstance(i, int)
                 or not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"layers must be in 0..{n_layers - 1} (n_layers {n_layers}), got "
                         f"{bad}")
    if detect_fake_mode() is None and target.type != "meta":
        raise ValueError(f"layers={sorted(keep)} builds part of a model, which only fake or "
                         f"meta tensors may do: real weights come from the whole model's "
                         f"seed (device {target})")
    return keep


def init_weights(module: nn.Module, std: float = INIT_STD) -> None:
    """Normal(0, ``std``) for every Linear/Embedding weight, zero biases, ones for norms.

    Visits modules in registration order so the result is a pure function of the RNG state.
    A tied weight is visited twice; the second draw simply overwrites the first.
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(m.weight)
        elif isinstance(m, Experts):
            m.reset_parameters(std)
