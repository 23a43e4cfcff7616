"""The same tensor-parallel layout with PyTorch's own DTensor tensor parallelism.

A reference for parity and speed, not labkit's implementation: ``parallelize_module`` with
``ColwiseParallel`` (``wq, wk, wv, w1, w3``, the head), ``RowwiseParallel`` (``wo, w2``, the
vocab-split embedding), ``SequenceParallel`` norms and ``PrepareModuleInput`` gathers when
sequence parallel, and the loss under ``loss_parallel()`` — the plan torchtitan applies to
Llama (torchtitan ``parallelize_llama``). It needs ``kv_heads ≥ tp`` (torch has no
replicated-K/V plan), and the attention modules' head counts are set to the local ones.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

__all__ = ["torch_tensor_parallel", "torch_loss_context", "torch_loss"]


def torch_tensor_parallel(model: nn.Module, mesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard a full-weight labkit ``GPT`` over the 1-D ``mesh`` in place, PyTorch's way.

    The logits come out as a DTensor sharded on the vocabulary (``Shard(-1)``); compute the
    loss with :func:`torch_loss` inside :func:`torch_loss_context` (forward and backward).

    Raises:
        ValueError: ``kv_heads < tp`` or heads not divisible by ``tp``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh.size()
    attn0 = model.layers[0].attn
    if attn0.n_kv_heads < tp or attn0.n_heads % tp or attn0.n_kv_heads % tp:
        raise ValueError(f"torch tensor parallelism here needs heads={attn0.n_heads} and "
                         f"kv_heads={attn0.n_kv_heads} divisible by tp={tp}")
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()
    tied = model.head.weight is model.tok_emb.weight
    top = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
           "head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                   use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    if tied:  # parallelize_module replaced each module's Parameter separately
        model.head.weight = model.tok_emb.weight
    for block in model.layers:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=stream),
                "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(output_layouts=stream)}
        if sp:
            plan.update({
                "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                           desired_input_layouts=(Replicate(), None)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
    return model


def torch_loss_context():
    """``torch.distributed.tensor.parallel.loss_parallel()``: run forward and backward in it."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def torch_loss(logits, targets, reduction: str = "mean"):
    """Cross-entropy of vocab-sharded DTensor logits ``(B, S, V)`` (inside the context)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction=reduction)
