"""Video as ViT tokens, and what a video-length sequence costs in activations per rank
(claim C45).

CS231N 2026 Lecture 11 (and its Lecture 10 on video) counts 5 minutes of 24 fps video cut
into ViT patches as about 1.41 M tokens: ``300 s × 24 = 7200`` frames, each a 224×224 image
cut into 16×16 patches as in Dosovitskiy et al. 2021 (ViT-B/16, §3.1 and Table 1's
resolution), ``(224/16)² = 196`` patches per frame: ``7200 × 196 = 1,411,200`` tokens in one
sequence. Attention over all of them is what pushes vision models into context parallelism:
no single accelerator holds even one layer's activations of that sequence, and the sequence
has to be split over ranks (Liu et al. 2023, ring attention).

:func:`vit_activation_bytes` is the planner's count of what the ViT's blocks keep for
backward on one rank of a ``cp × tp`` layout: the per-layer count Korthikanti et al. 2022
(§4, claim C18) give for a transformer block, for labkit's block shapes
(:func:`labkit.parallel.tensor.activations.block_activation_parts`), on the ``S/cp`` tokens
the rank holds. Bidirectional attention changes no term of it (flash attention keeps the
log-sum-exp, not the scores, either way). ``tests/test_vit_parallel.py`` checks it against
the bytes the training job's ViT blocks save, measured on two CPU ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VideoTokens", "video_tokens", "vit_activation_bytes", "VIT_B16"]


@dataclass(frozen=True)
class VideoTokens:
    """``frames`` (after tubelets) × ``patches_per_frame`` (+1 class token) = ``tokens``."""

    frames: int
    patches_per_frame: int
    tokens: int


def video_tokens(seconds: float, fps: float, image_size: int = 224, patch_size: int = 16,
                 tubelet: int = 1, cls_token: bool = False) -> VideoTokens:
    """Tokens a ViT sees for ``seconds`` of video at ``fps``, each frame ``image_size²``
    pixels cut into ``patch_size²`` patches (Dosovitskiy et al. 2021 §3.1): frames ×
    ``(image_size/patch_size)²``. ``tubelet``: frames per token in time (ViViT's tubelet
    embedding, Arnab et al. 2021 §3.2; 1 = each frame on its own, as the lecture counts);
    ``cls_token``: one class token for the clip.

    The lecture's ~1.41 M: ``video_tokens(300, 24)`` = 7200 frames × 196 patches =
    1,411,200 tokens.

    Raises:
        ValueError: a non-positive size, ``image_size`` not divisible by ``patch_size``, or
            the frame count not divisible by ``tubelet``.
    """
    for name, v in (("seconds", seconds), ("fps", fps), ("image_size", image_size),
                    ("patch_size", patch_size), ("tubelet", tubelet)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    if image_size % patch_size:
        raise ValueError(f"image_size={image_size} does not divide by patch_size={patch_size}")
    frames = seconds * fps
    if frames != int(frames) or int(frames) % tubelet:
        raise ValueError(f"{seconds} s × {fps} fps = {frames} frames: not a whole number of "
                         f"tubelets of {tubelet} frame(s)")
    frames = int(frames) // tubelet
    per = (image_size // patch_size) ** 2
    return VideoTokens(frames, per, frames * per + int(cls_token))


def _vit_b16():
    from ..config import ModelConfig

    # ViT-B/16's width, depth and heads (Dosovitskiy et al. 2021, Table 1) in labkit's block
    # (RMSNorm, SwiGLU at Llama's 8/3 width), mean-pooled: what labkit's ViT would be at scale
    return ModelConfig(kind="vit", n_layers=12, d_model=768, n_heads=12, image_size=224,
                       patch_size=16, n_classes=400, channels=3, pool="mean", seq_len=196,
                       name="vit-b16")


#: ViT-B/16's shape in labkit's ViT (see :func:`_vit_b16`)
VIT_B16 = _vit_b16()


def vit_activation_bytes(model_cfg, tokens: int, cp: int = 1, tp: int = 1, *,
                         sequence_parallel: bool = False, batch: int = 1,
                         bytes_per_elem: int = 2, resid_bytes: int | None = None) -> dict:
    """Bytes the ViT's blocks keep for backward on one rank, for ``batch`` sequences of
    ``tokens`` tokens split over ``cp`` context-parallel and ``tp`` tensor-parallel ranks,
    without recomputation (Korthikanti et al. 2022 §4 for labkit's block; SDPA/flash or
    ring attention, which keep the same tensors).

    Returns ``{"tokens_per_rank": S/cp, "per_layer": {part: bytes}, "layer": bytes,
    "blocks": bytes over all layers}``. What lies outside the blocks (the images, patch
    embedding output, final norm, pooled features) is a few ``(S/cp, H)``-sized tensors
    and is not counted.

    Raises:
        ValueError: ``tokens`` not divisible by ``cp``; heads, ffn or (with sequence
            parallelism) ``tokens/cp`` not divisible by ``tp``.
    """
    from ..parallel.tensor.activations import block_activation_parts

    if cp < 1 or tokens % cp:
        raise ValueError(f"tokens={tokens} do not split over cp={cp}")
    s = tokens // cp
    parts = block_activation_parts(model_cfg, batch, s, tp, sequence_parallel=sequence_parallel,
                                   bytes_per_elem=bytes_per_elem, resid_bytes=resid_bytes)
    layer = sum(parts.values())
    return {"tokens_per_rank": s, "per_layer": parts, "layer": layer,
            "blocks": layer * model_cfg.n_layers}
