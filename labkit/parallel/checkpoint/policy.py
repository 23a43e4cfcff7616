"""Checkpoint policies for the real GPT, with ``torch.utils.checkpoint``.

:func:`apply_checkpoint_policy` puts ``torch.utils.checkpoint`` (non-reentrant by default)
around the blocks of a labkit GPT: none / full / every-C / selective (Korthikanti et al.
2022 §5: recompute attention and element-wise ops, keep matmul outputs, via
``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

__all__ = ["POLICIES", "apply_checkpoint_policy", "keep_matmuls_policy"]

POLICIES = ("none", "full", "every", "selective")
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


def keep_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective policy: save the outputs of matmuls (mm, addmm, bmm, baddbmm); recompute the
    rest — attention (``scaled_dot_product_attention``), norms, RoPE, SiLU, products."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _restore(blocks) -> None:
    for b in blocks:
        b.__dict__.pop("forward", None)  # drop the instance override: the class forward is back
        b.__dict__.pop("checkpoint_policy", None)


def _ckpt_forward(fns, name, reentrant, preserve, context_fn):
    def run(x, *args):
        for fn in fns:
            x = fn(x, *args)
        return x

    def forward(x, *args):
        if not torch.is_grad_enabled():
            return run(x, *args)
        if reentrant and not any(isinstance(t, torch.Tensor) and t.requires_grad
                                 for t in (x, *args)):
            warnings.warn(f"labkit: reentrant checkpoint of {name} got no input that requires "
                          "grad, so its parameters will get no gradient (PyTorch documents this "
                          "for use_reentrant=True); use use_reentrant=False", UserWarning,
                          stacklevel=3)
        kw = {} if reentrant else {"context_fn": context_fn} if context_fn else {}
        return checkpoint(run, x, *args, use_reentrant=reentrant,
                          preserve_rng_state=preserve, **kw)
    return forward


def _passthrough(x, *args):
    return x


def apply_checkpoint_policy(model: nn.Module, policy: str, every: int = 1, *,
                            preserve_rng_state: bool = True, use_reentrant: bool = False,
                            layers=None) -> nn.Module:
    """Wrap the transformer blocks of ``model`` in ``torch.utils.checkpoint`` (in place).

    Policies: ``"none"`` (undo), ``"full"`` (each block recomputed in backward from its input),
    ``"every"`` (segments of ``every`` consecutive blocks, each segment stores only its input
    and is recomputed once: the ``checkpoint_sequential`` form), ``"selective"`` (each block
    keeps its matmul outputs and recomputes attention and element-wise ops,
    :func:`keep_matmuls_policy`). Parameters and ``state_dict`` keys do not change; in an
    ``"every"`` segment the first block runs the whole segment and the others pass ``x`` on.
    Calling again replaces the previous policy.

    Args:
        model: has ``.layers`` (an ``nn.ModuleList`` of blocks called as ``block(x, *args)``),
            unless ``layers`` is given.
        every: ``C`` for ``"every"``, ``1 <= C <= n_layers``.
        preserve_rng_state: stash and restore the RNG so dropout in a recomputed block draws
            the same mask (``False`` makes the gradients differ when there is dropout).
        use_reentrant: PyTorch's older mode; warns (``UserWarning``) when a block gets no input
            that requires grad, because its parameters then get no gradient.

    Returns:
        ``model``.

    Raises:
        ValueError: unknown policy; ``every`` outside ``1..n_layers`` (names both numbers);
            ``"selective"`` with ``use_reentrant=True`` (needs the non-reentrant mode).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; known: {', '.join(POLICIES)}")
    blocks = list(layers if layers is not None else getattr(model, "layers", None) or [])
    if not blocks:
        raise ValueError("model has no .layers to checkpoint; pass layers=[...]")
    n = len(blocks)
    if policy == "every":
        from .schedule import check_every

        every = check_every(n, every)
    if policy == "selective" and use_reentrant:
        raise ValueError("the selective policy needs use_reentrant=False")
    _restore(blocks)
    if policy == "none":
        return model
    size = every if policy == "every" else 1
    ctx_fn = (functools.partial(create_selective_checkpoint_contexts, keep_matmuls_policy)
              if policy == "selective" else None)
    for start in range(0, n, size):
        seg = blocks[start:start + size]
        name = f"layers[{start}]" if len(seg) == 1 else f"layers[{start}:{start + len(seg)}]"
        seg[0].forward = _ckpt_forward([type(b).forward.__get__(b) for b in seg], name,
                                       use_reentrant, preserve_rng_state, ctx_fn)
        for b in seg[1:]:
            b.forward = _passthrough
        for b in seg:
            b.checkpoint_policy = (policy, size)
    return model
