"""This rank's share of a global batch: data-parallel rows, microbatches, sequence shards.

Every rank draws the same global batch (:func:`labkit.models.data.make_batch`, a pure
function of ``(seed, step)``) and keeps its part, so no sampler state or broadcast exists:

* rows ``[d·B/dp, (d+1)·B/dp)`` for data-parallel index ``d`` (``dp`` = replicas × shards);
* with context parallelism, ``S/cp`` tokens of each sequence (:mod:`labkit.parallel.context`);
* microbatch ``m`` is rows ``[m·b, (m+1)·b)`` of those, ``b`` = ``micro_batch``.
"""
from __future__ import annotations

import torch

from ..models.data import make_batch
from ..trace import region

__all__ = ["local_rows", "rank_batch", "tokens_per_sample", "bf16_parameters"]


def local_rows(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Rows ``[index·B/parts, (index+1)·B/parts)`` of ``x`` (shape ``[B, ...]`` →
    ``[B/parts, ...]``, a view). ``B`` must be divisible by ``parts`` (validated)."""
    rows = x.shape[0] // parts
    return x[index * rows:(index + 1) * rows]


def rank_batch(cfg, step: int, dp_index: int, device, cp_index: int = 0) -> tuple:
    """This rank's ``(inputs, targets)`` of global step ``step`` on ``device``, in a traced
    ``"data"`` region: rows ``[global_batch/dp, ...]`` of its data-parallel index and, with
    context parallelism, its share ``S/cp`` of every sequence (contiguous or zigzag chunks;
    the targets are cut the same way, so each token keeps its next-token label)."""
    with region("data"):
        x, y = make_batch(cfg, step)
        dp, cp = cfg.parallel.dp, cfg.parallel.cp
        x, y = local_rows(x, dp_index, dp), local_rows(y, dp_index, dp)
        if cp > 1 and cfg.model_config.kind == "gpt":  # a ViT cuts its own patch tokens
            from ..parallel.context import shard_sequence

            x = shard_sequence(x, cp_index, cp, cfg.cp_zigzag, dim=1)
            y = shard_sequence(y, cp_index, cp, cfg.cp_zigzag, dim=1)
        if x.is_floating_point() and bf16_parameters(cfg):
            # images meet bf16 weights directly (no autocast to cast them), as autocast
            # would cast them for the patch embedding
            x = x.to(torch.bfloat16)
        return x.contiguous().to(device), y.contiguous().to(device)


def bf16_parameters(cfg) -> bool:
    """The model computes with bf16 parameters rather than under autocast: bf16 with ZeRO
    1-3 over more than one data rank keeps bf16 parameters in its flat units (fp32 masters
    in the optimizer); every other bf16 run autocasts the forward over fp32 weights."""
    p = cfg.parallel
    return cfg.precision == "bf16" and cfg.zero_stage > 0 and p.dp * p.cp > 1


def tokens_per_sample(cfg) -> int:
    """Loss terms per sample: ``seq_len`` next-token losses (GPT) or one label (ViT)."""
    mc = cfg.model_config
    return mc.seq_len if mc.kind == "gpt" else 1
