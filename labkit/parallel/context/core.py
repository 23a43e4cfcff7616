"""The attention core a context-parallel model calls, and the check made before launch.

``make_attention_core(method, group, causal=..., zigzag=..., seq_len=S)`` returns a callable
that replaces :func:`labkit.models.gpt.attention_core` through ``Attention.core``::

    for block in model.layers:
        block.attn.core = core
    model.positions = positions(rank, cp, S, zigzag)   # rotary at global positions

It takes ``q`` ``(B, A_local, S/cp, D)`` and ``k``/``v`` ``(B, K_local, S/cp, D)`` after
rotary and before any grouped-query repeat (``A_local``/``K_local``: this rank's heads after
tensor parallelism) and returns ``(B, A_local, S/cp, D)``: this rank's rows of the
single-process attention output.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import comm
from .allgather import allgather_attention
from .blocks import WorkCounter
from .layout import chunk_ids, chunk_len
from .ring import RingAttention, RingSpec
from .ulysses import ulysses_attention

__all__ = ["METHODS", "ContextAttention", "make_attention_core", "check_context_parallel"]

#: context-parallel attention methods
METHODS = ("allgather", "ulysses", "ring")


class ContextAttention:
    """A context-parallel attention core over ``group`` (see :func:`make_attention_core`).

    Attributes:
        method, causal, zigzag, seq_len: as given.
        cp, rank: the group's size and this rank's index in it.
        chunks: ``chunks[j]`` = global chunk indices rank ``j`` holds.
        chunk_len: tokens per chunk.
        counter: this rank's :class:`.blocks.WorkCounter` (every call adds to it).
    """

    def __init__(self, method: str, group, *, causal: bool = True, zigzag: bool = True,
                 seq_len: int):
        if method not in METHODS:
            raise ValueError(f"unknown context-parallel method {method!r}; choose one of "
                             f"{', '.join(METHODS)}")
        self.method, self.group, self.causal, self.zigzag = method, group, causal, zigzag
        self.cp, self.rank = comm.group_size(group), dist.get_rank(group)
        self.ranks = comm.group_ranks(group)
        self.seq_len = seq_len
        self.chunk_len = chunk_len(seq_len, self.cp, zigzag)
        self.chunks = tuple(chunk_ids(j, self.cp, zigzag) for j in range(self.cp))
        self.counter = WorkCounter()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``(B, A, S/cp, D)``, ``k``/``v`` ``(B, K, S/cp, D)`` → ``(B, A, S/cp, D)``.

        Raises:
            ValueError: shapes that do not match (sequence not ``S/cp``, ``K`` not dividing
                ``A``, ``k``/``v`` differing), or heads not divisible by ``cp`` for Ulysses.
        """
        local = self.seq_len // self.cp
        if q.dim() != 4 or k.shape != v.shape or q.shape[2] != local or k.shape[2] != local \
                or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
            raise ValueError(f"context-parallel attention expects q (B, A, {local}, D) and k, v "
                             f"(B, K, {local}, D) with K dividing A (seq_len={self.seq_len}, "
                             f"cp={self.cp}); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
        kw = dict(cp=self.cp, chunks=self.chunks, chunk_len=self.chunk_len,
                  causal=self.causal, counter=self.counter)
        if self.method == "ring":
            spec = RingSpec(self.group, self.ranks, self.rank, self.cp, self.chunks,
                            self.chunk_len, self.causal, self.counter)
            return RingAttention.apply(q, k, v, spec)
        if self.method == "allgather":
            return allgather_attention(q, k, v, group=self.group, rank=self.rank, **kw)
        return ulysses_attention(q, k, v, group=self.group, **kw)

    def __repr__(self) -> str:
        return (f"ContextAttention({self.method}, cp={self.cp}, rank={self.rank}, "
                f"causal={self.causal}, zigzag={self.zigzag}, seq_len={self.seq_len})")


def make_attention_core(method: str, group, *, causal: bool = True, zigzag: bool = True,
                        seq_len: int) -> ContextAttention:
    """The attention core for ``Attention.core`` under context parallelism over ``group``.

    Args:
        method: ``"allgather"`` (Dubey et al. 2024 §3.3.2), ``"ulysses"`` (Jacobs et al.
            2023) or ``"ring"`` (Liu et al. 2023).
        group: the context-parallel process group (its size is ``cp``).
        causal: causal mask (decoder) or none.
        zigzag: the tokens were sharded with the zigzag split (:mod:`.layout`).
        seq_len: the global sequence length ``S``.

    Returns:
        a :class:`ContextAttention`: ``core(q, k, v) -> out`` with ``q`` ``(B, A, S/cp, D)``,
        ``k``/``v`` ``(B, K, S/cp, D)``, ``out`` ``(B, A, S/cp, D)``.

    Raises:
        ValueError: unknown ``method``; ``seq_len`` not divisible by ``cp`` (``2·cp`` for
            zigzag).
    """
    return ContextAttention(method, group, causal=causal, zigzag=zigzag, seq_len=seq_len)


def check_context_parallel(model_cfg, cp: int, method: str, zigzag: bool, seq_len: int,
                           tp: int = 1) -> None:
    """Refuse, before any rank starts, a context-parallel layout that cannot run.

    Checks: ``method`` known; ``cp``, ``tp`` >= 1; ``seq_len`` within the model's rotary
    table (``model_cfg.seq_len``) and divisible by ``cp`` (by ``2·cp`` for zigzag); query and
    K/V heads divisible by ``tp``; for Ulysses, the heads per tensor-parallel rank divisible by
    ``cp`` (K/V heads are never replicated to make them fit).

    Raises:
        ValueError: naming the field and the numbers.
    """
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}; choose one of "
                         f"{', '.join(METHODS)}")
    for name, val in (("cp", cp), ("tp", tp)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
    if seq_len > model_cfg.seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the model's seq_len="
                         f"{model_cfg.seq_len} (its rotary table)")
    chunk_len(seq_len, cp, zigzag)
    heads, kv = model_cfg.n_heads, model_cfg.kv_heads
    if heads % tp or kv % tp:
        raise ValueError(f"n_heads={heads} and kv heads={kv} must divide by tp={tp}")
    if method == "ulysses":
        if (heads // tp) % cp:
            raise ValueError(f"Ulysses: query heads per tensor-parallel rank ({heads} / tp={tp} "
                             f"= {heads // tp}) do not divide by cp={cp}")
        if (kv // tp) % cp:
            raise ValueError(f"Ulysses: key/value heads per tensor-parallel rank ({kv} / tp={tp}"
                             f" = {kv // tp}) do not divide by cp={cp}; K/V heads are not "
                             "replicated: choose cp dividing them, or ring/allgather")
