"""Which transformer layers each pipeline stage holds: contiguous runs, equal or uneven.

``L`` layers over ``n`` stages. When ``n`` divides ``L`` every stage gets ``L/n``. Otherwise
(the default rule) every stage gets ``⌈L/n⌉`` and the shortfall ``n·⌈L/n⌉ − L`` is taken one
layer at a time from the first stage, the last, the second, the second-to-last, … — the ends
go first because they also carry the token embedding (first) and the final norm, output
head and loss (last). Llama 3 405B's 126 layers on 16 stages give 7, 8, …, 8, 7: one layer
fewer on the first and the last stage, which is how Llama 3 balanced its pipeline (Dubey et
al. 2024, "The Llama 3 Herd of Models", §3.3.2). An explicit list of per-stage counts
replaces the rule.

Pure Python (no torch): :func:`labkit.validate.validate_run` and :mod:`labkit.plan` use the
same rule as :class:`~.stage.StageModule`.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["stage_layer_counts", "layer_ranges"]


def _positive_int(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, int) and x >= 1


def stage_layer_counts(n_layers: int, n_stages: int,
                       counts: Optional[Sequence[int]] = None) -> list:
    """Layers on each of ``n_stages`` stages: ``counts`` checked, or the default rule.

    Args:
        n_layers: transformer layers ``L >= 1``.
        n_stages: pipeline stages ``n`` (all ranks' virtual stages together), ``1 <= n <= L``.
        counts: explicit per-stage layer counts (stage 0 first); ``None`` for the rule in the
            module docstring.

    Returns:
        ``n_stages`` positive ints summing to ``n_layers``.

    Raises:
        ValueError: ``n_layers`` or ``n_stages`` not a positive int, more stages than layers;
            ``counts`` of the wrong length, with an entry below 1, or not summing to
            ``n_layers`` (each message names the field and the numbers).
    """
    if not _positive_int(n_layers):
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    if not _positive_int(n_stages):
        raise ValueError(f"n_stages must be a positive int, got {n_stages!r}")
    if n_stages > n_layers:
        raise ValueError(f"n_stages={n_stages} stages but n_layers={n_layers}: more stages "
                         "than layers")
    if counts is not None:
        counts = list(counts)
        if len(counts) != n_stages:
            raise ValueError(f"stage_layers has {len(counts)} entries for n_stages="
                             f"{n_stages} stages: {counts}")
        bad = [c for c in counts if not _positive_int(c)]
        if bad:
            raise ValueError(f"stage_layers entries must be positive ints (every stage holds "
                             f"at least one layer), got {bad[0]!r} in {counts}")
        if sum(counts) != n_layers:
            raise ValueError(f"stage_layers {counts} sum to {sum(counts)}, not n_layers="
                             f"{n_layers}")
        return counts
    base = -(-n_layers // n_stages)
    out = [base] * n_stages
    short, i = base * n_stages - n_layers, 0
    while short:
        j = i // 2 if i % 2 == 0 else n_stages - 1 - i // 2
        out[j] -= 1
        short, i = short - 1, i + 1
    return out


def layer_ranges(n_layers: int, n_stages: int,
                 counts: Optional[Sequence[int]] = None) -> list:
    """Contiguous runs of layer indices, one ``range`` per stage, from
    :func:`stage_layer_counts` (same arguments, same errors): ``layer_ranges(126, 16)`` is
    ``[range(0, 7), range(7, 15), …, range(119, 126)]``."""
    out, start = [], 0
    for c in stage_layer_counts(n_layers, n_stages, counts):
        out.append(range(start, start + c))
        start += c
    return out
