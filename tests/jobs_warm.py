"""Jobs for tests/test_warm_rerun.py: the training job cold (the warm rank's cache of it
forgotten first) and warm, each reporting torch's generator state after it."""
from __future__ import annotations

import hashlib

import torch

from labkit.train import run


def _forget(ctx) -> None:
    for k in list(ctx.cache):
        name = k[0] if isinstance(k, tuple) else k
        if isinstance(name, str) and name.startswith("train."):
            del ctx.cache[k]


def _with_rng(ctx, cfg) -> dict:
    out = run(ctx, cfg)
    out["rng"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    return out


def train_cold(ctx, cfg) -> dict:
    """``labkit.train.run`` as on a fresh rank: nothing of an earlier run kept."""
    _forget(ctx)
    return _with_rng(ctx, cfg)


def train_warm(ctx, cfg) -> dict:
    """``labkit.train.run`` on the warm rank, as the pool runs it."""
    return _with_rng(ctx, cfg)


def train_unrestored(ctx, cfg) -> dict:
    """A re-run whose cache forgets to copy the composed values back into the kept stages
    (the planted bug the bit-identity checks must see)."""
    import labkit.train.cache as cache

    real = cache._restore_values
    cache._restore_values = lambda kept: None
    try:
        return _with_rng(ctx, cfg)
    finally:
        cache._restore_values = real


def leave_a_hook(ctx, cfg) -> dict:
    """What a careless job could leave on the kept stages: a forward hook that scales the
    first block's output. Returns how many stage modules were kept."""
    kept = ctx.cache.get(("train.stages", ctx.world_size))
    if kept is None:
        return {"kept": 0}
    for m in kept.stages.values():
        for block in m.layers:
            block.register_forward_hook(lambda mod, inp, out: out * 1.5)
            return {"kept": len(kept.stages)}
    return {"kept": 0}


def cache_contents(ctx, cfg) -> dict:
    """What the training job keeps on this rank: per kind of entry, how many."""
    out: dict = {}
    for k, v in ctx.cache.items():
        name = k[0] if isinstance(k, tuple) else k
        if isinstance(name, str) and name.startswith("train."):
            n = len(v) if name == "train.measured" else 1
            out[name] = out.get(name, 0) + n
    return out


def scramble_rng(ctx, cfg) -> None:
    """Advance torch's generator on every rank, as any job that draws random numbers does."""
    torch.rand(17)
