"""Which tokens a context-parallel rank holds: contiguous or zigzag chunks (load balance).

Context parallelism splits the sequence: each of ``cp`` ranks holds ``(B, S/cp, ...)`` of
every activation (claim C28). With causal attention query ``i`` attends keys ``0 … i``, so
under a **contiguous** split (rank ``r`` holds chunk ``r`` of ``cp``) the last rank's queries
see the whole prefix while rank 0's see only their own chunk: rank ``r`` does
``c²·r + c(c+1)/2`` query–key pairs (``c = S/cp``), a ``(2cp−1)/cp``-fold imbalance between
the busiest rank and the mean for large ``c``.

The **zigzag** split cuts the sequence into ``2·cp`` chunks of ``c = S/(2cp)`` and gives rank
``r`` chunks ``r`` and ``2cp−1−r``: an early and a late chunk, whose work sums to the same
``c²·(2cp−1) + c(c+1)`` on every rank. Llama 3 used exactly this split for its all-gather
context parallelism (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2); the same
layout balances ring attention (Liu et al. 2023 with the zigzag order of
``ring-flash-attention``).

Everything that lives on sequence positions must follow the same permutation: the token ids,
the labels (shift first, then shard, so label ``t`` stays beside token ``t``), and the rotary
positions (:func:`positions`, which ``GPT.positions`` takes).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["n_chunks", "chunk_ids", "chunk_len", "shard_sequence", "unshard_sequence",
           "positions", "tokens_per_rank", "causal_pairs_closed_form", "imbalance"]


def n_chunks(cp: int, zigzag: bool) -> int:
    """Chunks the sequence is cut into: ``2·cp`` (zigzag) or ``cp`` (contiguous)."""
    return 2 * cp if zigzag else cp


def chunk_ids(rank: int, cp: int, zigzag: bool) -> tuple:
    """Global chunk indices rank ``rank`` holds, in the order its local tensor stores them:
    ``(r, 2cp−1−r)`` for zigzag, ``(r,)`` for contiguous.

    Raises:
        ValueError: ``cp < 1`` or ``rank`` outside ``0 … cp−1``.
    """
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank must be in 0 … cp−1 with cp >= 1, got rank={rank}, cp={cp}")
    return (rank, 2 * cp - 1 - rank) if zigzag else (rank,)


def chunk_len(seq_len: int, cp: int, zigzag: bool) -> int:
    """Tokens per chunk: ``S/(2·cp)`` (zigzag) or ``S/cp``.

    Raises:
        ValueError: naming ``seq_len`` and the divisor when it does not divide.
    """
    n = n_chunks(cp, zigzag)
    if cp < 1 or seq_len < 1 or seq_len % n:
        how = "2·cp" if zigzag else "cp"
        raise ValueError(f"sequence length {seq_len} does not divide by {how} = {n} "
                         f"(cp={cp}, zigzag={zigzag})")
    return seq_len // n


def shard_sequence(x: torch.Tensor, rank: int, cp: int, zigzag: bool,
                   dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along the sequence dim: ``(B, S, …)`` → ``(B, S/cp, …)``.

    Token ids, labels (already shifted), or any activation; ``dim`` is the sequence dim
    (1 for ``(B, S)``, 2 for ``(B, heads, S, D)``). Returns a contiguous copy.

    Raises:
        ValueError: ``S`` does not divide by ``cp`` (``2·cp`` for zigzag).
    """
    s = x.shape[dim]
    c = chunk_len(s, cp, zigzag)
    parts = [x.narrow(dim, i * c, c) for i in chunk_ids(rank, cp, zigzag)]
    return torch.cat(parts, dim=dim).contiguous()


def unshard_sequence(shards: Sequence[torch.Tensor], zigzag: bool,
                     dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank's shard (rank order) → the full tensor."""
    cp = len(shards)
    per = n_chunks(cp, zigzag) // cp
    c = shards[0].shape[dim] // per
    chunks: dict = {}
    for r, sh in enumerate(shards):
        for j, cid in enumerate(chunk_ids(r, cp, zigzag)):
            chunks[cid] = sh.narrow(dim, j * c, c)
    return torch.cat([chunks[i] for i in range(len(chunks))], dim=dim)


def positions(rank: int, cp: int, seq_len: int, zigzag: bool, device=None) -> torch.Tensor:
    """Global positions (int64 ``(S/cp,)``) of the tokens rank ``rank`` holds, in its local
    order: what rotary embeddings must use (set ``model.positions`` to it; see
    :func:`labkit.models.gpt.rope_slice`).

    Raises:
        ValueError: ``seq_len`` does not divide by ``cp`` (``2·cp`` for zigzag).
    """
    return shard_sequence(torch.arange(seq_len, device=device).unsqueeze(0), rank, cp,
                          zigzag).squeeze(0)


def tokens_per_rank(seq_len: int, cp: int) -> int:
    """Tokens of one sequence each rank holds under ``cp``-way context parallelism
    (claim C29: Llama 3 405B's long-context stage, 131,072 tokens on CP16 → 8,192).

    Raises:
        ValueError: ``cp < 1`` or ``seq_len`` not divisible by ``cp``.
    """
    if cp < 1 or seq_len % cp:
        raise ValueError(f"sequence length {seq_len} does not divide by cp={cp}")
    return seq_len // cp


def causal_pairs_closed_form(rank: int, cp: int, seq_len: int, zigzag: bool,
                             causal: bool = True) -> int:
    """Unmasked query–key pairs (per batch row and query head) rank ``rank`` computes when
    its queries attend the whole sequence: a chunk ``q`` against chunk ``k`` has ``c²``
    pairs when ``q > k`` (or without a causal mask), ``c(c+1)/2`` when ``q = k``, none when
    ``q < k``. Contiguous: ``c²·r + c(c+1)/2``; zigzag: ``c²·(2cp−1) + c(c+1)`` on every rank.
    """
    c = chunk_len(seq_len, cp, zigzag)
    total = 0
    for qc in chunk_ids(rank, cp, zigzag):
        total += (qc * c * c + c * (c + 1) // 2) if causal else seq_len * c
    return total


def imbalance(work: Sequence[float]) -> float:
    """Busiest rank's work over the mean (1.0 = perfectly balanced)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0
