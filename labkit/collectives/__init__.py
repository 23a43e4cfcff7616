"""Collectives, two ways: torch.distributed's, and built by hand from point-to-point messages.

Every hand-built algorithm communicates only through :mod:`labkit.comm`'s ``send``/``recv``/
``batch_isend_irecv``, so the bytes it moves are traced and counted like any collective's.

====================  ==========================================  ============================
op                    hand-built algorithms                       module
====================  ==========================================  ============================
``all_reduce``        ``ring`` (reduce-scatter + all-gather),     :mod:`.ring`, :mod:`.tree`
                      ``recursive_doubling`` (latency-optimal)
``reduce_scatter``    ``ring``                                    :mod:`.ring`
``all_gather``        ``ring``                                    :mod:`.ring`
``all_to_all``        ``pairwise`` (pairwise exchange)            :mod:`.pairwise`
``broadcast``         ``tree`` (binomial tree)                    :mod:`.tree`
``reduce``            ``tree`` (binomial tree)                    :mod:`.tree`
====================  ==========================================  ============================

``"native"`` is always available: the op through :mod:`labkit.comm` → torch.distributed.

Byte formulas (per rank, each way, for a message of ``S`` bytes over ``N`` ranks):
ring all-reduce 2(N−1)/N·S; reduce-scatter, all-gather, all-to-all (N−1)/N·S; broadcast and
reduce S per hop (:func:`formula_bytes` gives every rank's exact count, tree and recursive
doubling included). Bus bandwidth factors follow nccl-tests ``PERFORMANCE.md``
(:func:`busbw_factor`).

Sources: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009 (the ring); Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005 (binomial tree, recursive
doubling, pairwise exchange); NVIDIA nccl-tests ``doc/PERFORMANCE.md`` (algbw, busbw).
"""
from __future__ import annotations

import importlib
import math
from typing import Optional

import torch

__all__ = ["OPS", "ALGORITHMS", "HAND_BUILT", "REDUCE_OPS", "busbw_factor", "formula_bytes",
           "formula_text", "tree_children", "check_algorithm", "check_reduce",
           "check_divisible", "combine_",
           "ring", "tree", "pairwise", "record", "jobs", "bench"]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")

#: algorithms per op; ``native`` is torch.distributed through labkit.comm
ALGORITHMS = {"all_reduce": ("native", "ring", "recursive_doubling"),
              "reduce_scatter": ("native", "ring"), "all_gather": ("native", "ring"),
              "all_to_all": ("native", "pairwise"), "broadcast": ("native", "tree"),
              "reduce": ("native", "tree")}

#: the hand-built algorithm the benchmark puts beside native, per op
HAND_BUILT = {"all_reduce": "ring", "reduce_scatter": "ring", "all_gather": "ring",
              "all_to_all": "pairwise", "broadcast": "tree", "reduce": "tree"}

REDUCE_OPS = ("sum", "max", "min", "avg", "product")
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_SUBMODULES = ("ring", "tree", "pairwise", "record", "jobs", "bench")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- validation
def check_algorithm(op: str, algorithm: str) -> None:
    """Raises ``ValueError`` naming the choices when ``op``/``algorithm`` is unknown."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")
    if algorithm not in ALGORITHMS[op]:
        raise ValueError(f"{op} has no algorithm {algorithm!r}; choose one of "
                         f"{', '.join(ALGORITHMS[op])}")


def check_reduce(reduce: str, dtype: torch.dtype) -> None:
    """Raises ``ValueError`` for an unknown reduce op, or ``avg`` of an integer dtype (an
    average of integers is not an integer: convert with ``x.float()`` first)."""
    if reduce not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {reduce!r}; use one of {', '.join(REDUCE_OPS)}")
    if reduce == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"reduce='avg' needs a floating-point tensor, got {dtype}: convert "
                         "it first (x.float()), or reduce with 'sum' and divide yourself")


def check_divisible(numel: int, n: int, what: str) -> int:
    """``numel // n``; raises ``ValueError`` saying how to pad when ``n`` does not divide it.

    The message names the padded size and the call that pads, e.g.
    ``torch.nn.functional.pad(x.flatten(), (0, 2))`` for 10 elements over 4 ranks.
    """
    if n < 1 or numel % n:
        padded = -(-numel // n) * n if n >= 1 else numel
        raise ValueError(
            f"{what}: {numel} elements do not split into N={n} equal chunks; pad the flat "
            f"input to {padded} elements first, e.g. torch.nn.functional.pad(x.flatten(), "
            f"(0, {padded - numel})), and drop the padding from the result")
    return numel // n


def combine_(acc: torch.Tensor, x: torch.Tensor, reduce: str) -> torch.Tensor:
    """``acc ⊕= x`` in place (``avg`` sums; the caller divides by N at the end)."""
    if reduce in ("sum", "avg"):
        return acc.add_(x)
    if reduce == "max":
        return torch.maximum(acc, x, out=acc)
    if reduce == "min":
        return torch.minimum(acc, x, out=acc)
    if reduce == "product":
        return acc.mul_(x)
    raise ValueError(f"unknown reduce op {reduce!r}; use one of {', '.join(REDUCE_OPS)}")


# --------------------------------------------------------------------------- formulas
def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw × factor, algbw = S / time.

    2(N−1)/N for all-reduce; (N−1)/N for reduce-scatter, all-gather, all-to-all; 1 for
    broadcast and reduce. ``S`` is the full message: the all-reduce buffer, the
    reduce-scatter input, the all-gather output, one rank's all-to-all input.
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")


def tree_children(vrank: int, n: int) -> int:
    """Children of ``vrank`` (rank relative to the root) in the binomial tree of ``n``."""
    low = vrank.bit_length()  # vrank receives on round low-1, then sends on rounds >= low
    return sum(1 for k in range(low, max(n - 1, 1).bit_length()) if vrank + (1 << k) < n)


def formula_bytes(op: str, n: int, s: float, algorithm: str = "ring", rank: int = 0,
                  root: int = 0) -> tuple[float, float]:
    """Bytes ``(sent, received)`` by group rank ``rank`` for one op on an ``s``-byte message.

    * ring / native all-reduce: 2(N−1)/N·S each way;
    * reduce-scatter, all-gather, all-to-all (any algorithm): (N−1)/N·S each way;
    * broadcast / reduce: S per hop. Native (as :mod:`labkit.comm` counts it): the root
      sends (broadcast) or receives (reduce) S, every other rank the opposite. Tree: a rank
      exchanges S with its parent and S with each child of the binomial tree, so the sum
      over ranks is (N−1)·S each way;
    * recursive doubling: log2(N)·S each way when N is a power of two. Otherwise, with
      p = 2^⌊log2 N⌋ and r = N − p, ranks below 2r pair up first: even ones send S and
      later receive S; odd ones add (log2 p + 1)·S each way; ranks from 2r on log2(p)·S.

    Raises:
        ValueError: an unknown op or algorithm.
    """
    check_algorithm(op, algorithm)
    if op == "all_reduce" and algorithm == "recursive_doubling":
        p = 1 << (n.bit_length() - 1)
        rem, k = n - p, int(math.log2(p))
        if rank < 2 * rem:
            both = s if rank % 2 == 0 else (k + 1) * s
        else:
            both = k * s
        return float(both), float(both)
    if op == "all_reduce":
        return 2 * (n - 1) * s / n, 2 * (n - 1) * s / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) * s / n, (n - 1) * s / n
    vr = (rank - root) % n
    if algorithm == "native":
        one = (s, 0.0) if vr == 0 else (0.0, s)
    else:
        kids, parent = tree_children(vr, n) * s, (s if vr else 0.0)
        one = (kids, parent)  # broadcast: send to children, receive from parent
    return (float(one[0]), float(one[1])) if op == "broadcast" else (float(one[1]),
                                                                       float(one[0]))


def formula_text(op: str, algorithm: str = "ring", n: Optional[int] = None) -> str:
    """The formula :func:`formula_bytes` evaluates, as text (per rank, each way).

    With ``n``, recursive doubling over a non-power-of-two ``n`` gets its own rule (the
    ranks that fold into a partner first send less, their partners more), e.g. for N=3:
    ``"p=2^⌊log2 N⌋=2: ranks 0–1 fold first (even S, odd (log2 p+1)·S), rank 2 log2(p)·S"``.
    """
    if op == "all_reduce":
        if algorithm != "recursive_doubling":
            return "2(N−1)/N·S"
        if n is None or n < 2 or n & (n - 1) == 0:
            return "log2(N)·S"
        p = 1 << (n.bit_length() - 1)
        fold = 2 * (n - p)
        rest = (f"ranks {fold}–{n - 1}" if n - 1 > fold else f"rank {fold}") if fold < n else ""
        return (f"p=2^⌊log2 N⌋={p}: ranks 0–{fold - 1} fold first (even S, odd (log2 p+1)·S)"
                + (f", {rest} log2(p)·S" if rest else ""))
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return "(N−1)/N·S"
    return "S per hop"
