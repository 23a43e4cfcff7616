"""Jobs for tests/test_fake_rank.py."""
from __future__ import annotations


def read_corpus(ctx, config) -> int:
    """Read the text corpus on this rank (cached per process), so that a one-step job's
    tracked memory does not count its first read."""
    from labkit.models.data import text_corpus

    return int(text_corpus("train").numel())
