"""Models and data for labkit: a Llama-style ``GPT``, a small ``ViT``, and local datasets.

``build_model`` is the one entry point rank processes use, so that every rank builds
bit-identical weights from the same seed without a broadcast.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import ModelConfig
from .data import digits_batch, make_batch, text_batch
from .gpt import GPT, count_params
from .vit import ViT

__all__ = ["GPT", "ViT", "build_model", "count_params", "text_batch", "digits_batch",
           "make_batch"]


def build_model(model_cfg: ModelConfig, device="cpu", seed: int = 0,
                attention: str = "sdpa", layers=None) -> nn.Module:
    """Build ``GPT`` or ``ViT`` (by ``model_cfg.kind``) on ``device`` after
    ``torch.manual_seed(seed)``, so equal arguments give identical weights on every rank.
    ``layers``: a GPT with only these blocks, under fake tensors only (see :class:`GPT`).

    Note that this reseeds torch's global CPU RNG as a side effect.

    Raises:
        ValueError: invalid ``model_cfg`` or unknown ``attention``; ``layers`` for a ViT, or
            refused by :class:`GPT`.
    """
    model_cfg.validate()
    torch.manual_seed(seed)
    kw = {}
    if layers is not None:
        if model_cfg.kind == "vit":
            raise ValueError("layers: only a GPT can be built in part, got kind='vit'")
        kw["layers"] = layers
    cls = ViT if model_cfg.kind == "vit" else GPT
    if torch.device(device).type in ("cpu", "meta"):
        return cls(model_cfg, attention=attention, device=device, **kw)
    # initialise on the CPU generator, then move: the same seed must give the same weights
    # on every device, or a GPU run could never match the CPU reference
    return cls(model_cfg, attention=attention, device="cpu", **kw).to(device)
