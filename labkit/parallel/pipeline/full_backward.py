"""Pipeline schedules whose backward is one pass (``BW``): GPipe, 1F1B, interleaved 1F1B.

Pure generators of per-rank :class:`~.actions.Action` lists (the data model and the other
schedules: :mod:`.schedules`). Sources: GPipe — Huang et al. 2019; 1F1B — Narayanan et al.
2019 (PipeDream-Flush) and Narayanan et al. 2021 (Megatron-LM) §2.2.1; interleaved 1F1B —
Narayanan et al. 2021 §2.2.2.
"""
from __future__ import annotations

from .actions import Action, Schedule

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b"]


def _check(p: int, m: int, v: int = 1) -> None:
    for name, val in (("pp", p), ("microbatches", m), ("virtual_stages", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019, Fig. 2c). Every rank holds all
    ``M`` microbatches' activations at the turn."""
    _check(p, m)
    acts = tuple(tuple([Action(r, "F", i) for i in range(m)]
                       + [Action(r, "BW", i) for i in range(m)]) for r in range(p))
    return Schedule("gpipe", p, m, 1, "loop", acts, warmup=tuple([m] * p))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021 §2.2.1, Fig. 4 top): rank ``r`` runs
    ``min(P−1−r, M)`` warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. At most ``P−r`` microbatches in flight on rank ``r``."""
    _check(p, m)
    out, warm = [], []
    for r in range(p):
        w = min(p - 1 - r, m)
        seq = [Action(r, "F", i) for i in range(w)]
        for i in range(m - w):
            seq += [Action(r, "F", w + i), Action(r, "BW", i)]
        seq += [Action(r, "BW", i) for i in range(m - w, m)]
        out.append(tuple(seq))
        warm.append(w)
    return Schedule("1f1b", p, m, 1, "loop", tuple(out), warmup=tuple(warm))


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2.2, Fig. 4 bottom): rank ``r`` holds the
    ``V`` stages ``r, r+P, …``; microbatches go through in groups of ``g = min(P, M)``, chunk
    by chunk. Warm-up forwards ``min((V−1)·g + 2·(P−1−r), M·V)`` (Megatron-LM's count),
    then 1F1B over (chunk, microbatch) units. The bubble shrinks by ``V``.

    Raises:
        ValueError: ``V < 2``, or ``M`` above ``P`` and not a multiple of it.
    """
    _check(p, m, v)
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs virtual_stages >= 2, got {v}")
    if m > p and m % p:
        raise ValueError(f"interleaved 1F1B needs microbatches={m} to be <= pp={p} or a "
                         f"multiple of it (Megatron-LM's requirement)")
    g = min(p, m)

    def unit(k: int, backward: bool) -> tuple:
        chunk = (k // g) % v
        mb = (k // (g * v)) * g + k % g
        return (v - 1 - chunk if backward else chunk), mb

    out, warm = [], []
    total = m * v
    for r in range(p):
        w = min((v - 1) * g + 2 * (p - 1 - r), total)
        seq = []
        f = b = 0
        for _ in range(w):
            c, mb = unit(f, False)
            seq.append(Action(c * p + r, "F", mb))
            f += 1
        while f < total:
            c, mb = unit(f, False)
            seq.append(Action(c * p + r, "F", mb))
            f += 1
            c, mb = unit(b, True)
            seq.append(Action(c * p + r, "BW", mb))
            b += 1
        while b < total:
            c, mb = unit(b, True)
            seq.append(Action(c * p + r, "BW", mb))
            b += 1
        out.append(tuple(seq))
        warm.append(w)
    return Schedule("interleaved", p, m, v, "loop", tuple(out), warmup=tuple(warm))
