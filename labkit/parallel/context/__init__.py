"""Context parallelism: the sequence split over ``cp`` ranks, attention made whole again.

Each rank holds ``(B, S/cp, H)`` of every activation (claim C28); everything but attention
is per token and needs nothing new. Attention needs every key for every query, and the three
classic ways to provide them are here, all built on :mod:`labkit.comm`:

============  ==================================================  =================================
method        what moves                                          module
============  ==================================================  =================================
allgather     K/V all-gathered, dK/dV reduce-scattered            :mod:`.allgather` (Llama 3)
ulysses       Q, K, V, O all-to-all: sequence ↔ heads             :mod:`.ulysses` (Jacobs 2023)
ring          K/V (and dK/dV) around a ring, under the compute    :mod:`.ring` (Liu 2023)
============  ==================================================  =================================

* :mod:`.layout` — contiguous vs zigzag chunks, :func:`shard_sequence`, :func:`positions`,
  the closed-form causal work per rank, :func:`tokens_per_rank` (C29).
* :mod:`.blocks` — blockwise attention with an explicit log-sum-exp (forward, backward,
  merge) and the per-rank work counter.
* :mod:`.core` — :func:`make_attention_core` (the ``Attention.core`` hook) and
  :func:`check_context_parallel` (refuse before launch).
* :mod:`.measure` — work, bytes, overlap, memory beside their formulas.
* :mod:`.jobs` — the standalone jobs: one attention call, and the whole GPT.
"""
from .core import METHODS, ContextAttention, check_context_parallel, make_attention_core
from .layout import (causal_pairs_closed_form, chunk_ids, imbalance, positions,
                     shard_sequence, tokens_per_rank, unshard_sequence)

__all__ = ["METHODS", "ContextAttention", "make_attention_core", "check_context_parallel",
           "shard_sequence", "unshard_sequence", "positions", "chunk_ids", "tokens_per_rank",
           "causal_pairs_closed_form", "imbalance"]
