"""Model shapes for pipeline lessons: deep enough to split into 2, 4 or 8 stages.

Both are :class:`~labkit.config.ModelConfig`\\ s for ``RunConfig(model=...)``.
"""
from __future__ import annotations

from ...config import ModelConfig

__all__ = ["PP_TINY", "PP_BALANCED"]

#: 8 thin layers: splits into 2, 4 or 8 stages; a few ms per microbatch on one core
PP_TINY = ModelConfig(n_layers=8, d_model=32, n_heads=4, seq_len=16, name="pp-tiny")

#: 8 layers wide enough that a stage's compute (~10–40 ms per microbatch of 2 on one core)
#: outweighs the executor's ~0.5 ms per action: the model for timing bubbles
PP_BALANCED = ModelConfig(n_layers=8, d_model=256, n_heads=4, seq_len=128,
                          name="pp-balanced")
