"""Rotary position embeddings (Su et al. 2021, RoFormer §3.4): the cos/sin tables, the rows
a rank's attention uses, and the rotation itself, as :class:`labkit.models.gpt.GPT`'s
attention applies them.

Shapes use ``S`` sequence length and ``D`` = ``head_dim``.
"""
from __future__ import annotations

from typing import Optional

import torch


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin tables (RoFormer §3.4.2), each float32 ``(seq_len, head_dim // 2)``.

    Frequency ``i`` is ``theta ** (-2i / head_dim)``; position ``m`` rotates pair ``i`` by
    ``m · freq_i`` radians.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                         / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_slice(cos: torch.Tensor, sin: torch.Tensor, s: int,
               positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables attention uses: the first ``s``, or the rows
    ``positions`` (int64 ``(n,)``, the positions of the tokens attention sees on this rank)
    when they are not ``0 … s−1``: context parallelism's zigzag split, or sequence
    parallelism, where the residual stream holds ``s = n/tp`` tokens but attention all of
    them."""
    if positions is None:
        return cos[:s], sin[:s]
    return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, heads, S, D)`` by position; ``cos``/``sin`` are ``(S, D // 2)``.

    Uses the half-split pairing (dimension ``i`` with ``i + D/2``), as in the GPT-NeoX and
    Hugging Face Llama code; it is a fixed permutation of RoFormer's interleaved pairs, so
    relative-position behaviour is identical.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)
