"""Vocab-parallel token embedding and output head (Shoeybi et al. 2019, §3, "input
embedding … parallelized along the vocabulary dimension").

Rank ``r`` of ``T`` holds vocabulary rows ``[r·V'/T, (r+1)·V'/T)`` of the ``(V', H)`` table,
where ``V'`` is ``V`` rounded up to a multiple of ``T`` (Megatron-LM pads the vocabulary the
same way; gpt2's 50,257 tokens do not divide by 2). The padding rows are zeros, never looked
up by a token, and their logits are masked out of the softmax by
:func:`labkit.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy`, so the loss and
every gradient equal the unpadded model's; :func:`padding` reports their bytes.

* Embedding: a token outside this rank's rows contributes zeros; the ranks' partial
  ``(B, S, H)`` sum to the full lookup through ``g`` (all-reduce), or with sequence
  parallelism through a reduce-scatter that leaves ``(B, S/T, H)``.
* Head: column-parallel over the vocabulary; the logits stay sharded ``(B, S, V'/T)``,
  never gathered (the loss works on the shards).

A tied head and embedding shard the same rows, so on one rank they stay one Parameter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functions import tp_size
from .layers import column_matmuls, row_output

__all__ = ["padded_vocab", "padding", "shard_vocab", "VocabParallelEmbedding",
           "VocabParallelHead"]


def padded_vocab(vocab_size: int, tp: int) -> int:
    """``V`` rounded up to a multiple of ``tp``."""
    return -(-vocab_size // tp) * tp


def padding(vocab_size: int, d_model: int, tp: int, rank: int, bytes_per_elem: int = 4,
            tables: int = 1) -> dict:
    """Padding of the vocab-parallel tables on ``rank``.

    Returns ``{"padded_vocab", "rows" (padding rows on this rank), "total_rows",
    "bytes" (this rank: rows·H·bytes_per_elem·tables), "total_bytes" (all ranks)}``;
    ``tables`` is 1 for a tied embedding/head, 2 for untied (each is padded).
    """
    vp = padded_vocab(vocab_size, tp)
    per = vp // tp
    lo, hi = rank * per, (rank + 1) * per
    rows = hi - max(lo, min(hi, vocab_size))
    unit = d_model * bytes_per_elem * tables
    return {"padded_vocab": vp, "rows": rows, "total_rows": vp - vocab_size,
            "bytes": rows * unit, "total_bytes": (vp - vocab_size) * unit}


def shard_vocab(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This rank's rows of the ``(V, H)`` table, zero rows past ``V``: ``(V'/T, H)``."""
    v, h = weight.shape
    per = padded_vocab(v, tp) // tp
    out = torch.zeros(per, h, dtype=weight.dtype, device=weight.device)
    lo, hi = rank * per, min((rank + 1) * per, v)
    if hi > lo:
        out[:hi - lo] = weight.detach()[lo:hi]
    return out


class VocabParallelEmbedding(nn.Module):
    """Token ids ``(B, S)`` → ``(B, S, H)``, or ``(B, S/T, H)`` with sequence parallelism.

    ``weight`` ``(V'/T, H)`` holds rows ``[vocab_start, vocab_start + V'/T)``.
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, group, *,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight, self.vocab_start = weight, vocab_start
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        if tp_size(self.group) == 1:
            return F.embedding(idx, self.weight)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return row_output(out, self.group, sequence_parallel=self.sequence_parallel,
                          site="emb_out")

    def extra_repr(self) -> str:
        return _rows(self)


class VocabParallelHead(nn.Module):
    """``(B, S, H)`` (or ``(B, S/T, H)`` with sequence parallelism) → vocab-sharded logits
    ``(B, S, V'/T)``: columns ``[vocab_start, vocab_start + V'/T)`` of the full logits, the
    padding columns (ids ``≥ V``) included."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group, *,
                 sequence_parallel: bool = False, regather: bool = False):
        super().__init__()
        self.weight, self.vocab_start = weight, vocab_start
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_matmuls(x, (self.weight,), self.group,
                              sequence_parallel=self.sequence_parallel,
                              regather=self.regather, site="head_in")[0]

    def extra_repr(self) -> str:
        return _rows(self)


def _rows(m: nn.Module) -> str:
    lo = m.vocab_start
    return f"rows=[{lo}, {lo + m.weight.shape[0]}), tp={tp_size(m.group)}"
