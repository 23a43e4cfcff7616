"""Real, local, deterministic training data: stdlib bytes for GPT, sklearn digits for ViT.

Every batch is a pure function of ``(step, global_batch, ..., seed, split)``: one
NumPy generator seeded from ``(seed, step)`` draws all ``global_batch`` rows, so a
data-parallel rank ``r`` of ``N`` that keeps rows ``[r·B/N, (r+1)·B/N)`` sees exactly its
share of what a single process would see, with no communication and no sampler state.
Rows are sampled with replacement (i.i.d. per step), as in nanoGPT-style training loops.
"""
from __future__ import annotations

import functools
import os
import sysconfig

import numpy as np
import torch

__all__ = ["text_corpus", "text_batch", "digits_data", "digits_batch", "make_batch",
           "MAX_CORPUS_BYTES", "VAL_FRACTION"]

MAX_CORPUS_BYTES = 4 * 2**20  # enough for byte-level toy LMs; reads in well under a second
VAL_FRACTION = 0.1
_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
_SPLITS = ("train", "val")


def _rng(seed: int, step: int) -> np.random.Generator:
    # SeedSequence hashes the whole (seed, step) pair; torch.Generator.manual_seed keeps
    # only 32 bits, so packing both ints into one torch seed would make streams collide
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    return np.random.default_rng([seed, step])


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def _stdlib_sources(root: str) -> list[str]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        paths += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
    # sort on "/"-joined relative paths so the order is the same on every OS and walk order
    return sorted(paths, key=lambda p: p.replace(os.sep, "/"))


@functools.lru_cache(maxsize=None)
def text_corpus(split: str = "train") -> torch.Tensor:
    """Bytes of the running Python's stdlib ``*.py`` sources, uint8 1-D tensor.

    Files are concatenated in sorted relative-path order (``test``, ``tests``,
    ``idlelib`` and ``site-packages`` folders skipped) up to ``MAX_CORPUS_BYTES``;
    the last ``VAL_FRACTION`` of it is the ``"val"`` split, the rest ``"train"``.
    Read once per process and cached.

    Raises:
        ValueError: unknown ``split``.
        RuntimeError: no stdlib sources found (e.g. a stripped, .pyc-only install).
    """
    _check_split(split)
    data = _full_corpus()
    cut = int(len(data) * (1 - VAL_FRACTION))
    return data[:cut] if split == "train" else data[cut:]


@functools.lru_cache(maxsize=None)
def _full_corpus() -> torch.Tensor:
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for rel in _stdlib_sources(root):
        with open(os.path.join(root, rel), "rb") as f:
            chunk = f.read(MAX_CORPUS_BYTES - total)
        chunks.append(chunk)
        total += len(chunk)
        if total >= MAX_CORPUS_BYTES:
            break
    if not total:
        raise RuntimeError(f"no *.py files found under the stdlib path {root!r}")
    buf = bytearray(b"".join(chunks))  # writable, so torch.frombuffer does not warn
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def text_batch(step: int, global_batch: int, seq_len: int, seed: int = 0,
               split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the byte corpus for next-byte prediction.

    Returns ``(x, y)``, both int64 ``(global_batch, seq_len)`` with values in ``[0, 256)``
    and ``y[:, t] == x[:, t + 1]`` inside each window (``y`` is ``x`` shifted by one byte).

    Raises:
        ValueError: unknown ``split``, negative ``step``/``seed``, ``global_batch < 1``, or
            ``seq_len`` not in ``[1, len(split) - 1]``.
    """
    data = text_corpus(split)
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if not 1 <= seq_len < len(data):
        raise ValueError(f"seq_len={seq_len} must be in [1, {len(data) - 1}] for the "
                         f"{split!r} split of {len(data)} bytes")
    starts = torch.from_numpy(_rng(seed, step).integers(0, len(data) - seq_len, global_batch))
    window = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return window[:, :-1], window[:, 1:]


@functools.lru_cache(maxsize=None)
def digits_data(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), cached.

    Returns ``(images float32 (N, 1, 8, 8) in [0, 1], labels int64 (N,))``; ``"val"`` is
    the last ``VAL_FRACTION`` of the dataset order (already class-interleaved), ``"train"``
    the rest.

    Raises:
        ValueError: unknown ``split``.
    """
    _check_split(split)
    from sklearn.datasets import load_digits  # deferred: sklearn import costs ~1 s

    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels 0..16
    labels = torch.tensor(d.target, dtype=torch.int64)
    cut = int(len(labels) * (1 - VAL_FRACTION))
    sl = slice(0, cut) if split == "train" else slice(cut, None)
    return images[sl].contiguous(), labels[sl].contiguous()


def digits_batch(step: int, global_batch: int, seed: int = 0,
                 split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """``global_batch`` digits drawn with replacement, a pure function of the arguments.

    Returns ``(images float32 (B, 1, 8, 8) in [0, 1], labels int64 (B,))``.

    Raises:
        ValueError: unknown ``split``, negative ``step``/``seed``, ``global_batch < 1``.
    """
    images, labels = digits_data(split)
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    idx = torch.from_numpy(_rng(seed, step).integers(0, len(labels), global_batch))
    return images[idx], labels[idx]


def make_batch(run_cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full global batch ``(inputs, targets)`` of ``run_cfg`` at ``step``.

    ``run_cfg.dataset == "text"``: ``text_batch`` with the model's ``seq_len``;
    ``"digits"``: ``digits_batch``. Both use ``run_cfg.global_batch`` rows and
    ``run_cfg.seed``; data-parallel ranks slice the rows they own.

    Raises:
        ValueError: unknown ``run_cfg.dataset``.
    """
    if run_cfg.dataset == "text":
        return text_batch(step, run_cfg.global_batch, run_cfg.model_config.seq_len,
                          seed=run_cfg.seed)
    if run_cfg.dataset == "digits":
        return digits_batch(step, run_cfg.global_batch, seed=run_cfg.seed)
    raise ValueError(f"dataset must be 'text' or 'digits', got {run_cfg.dataset!r}")
