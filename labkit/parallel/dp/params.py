"""The parameters a data-parallel wrapper handles, and how it starts them equal.

Shared by :class:`~.ddp.DataParallel` and the ZeRO wrappers (:mod:`labkit.parallel.zero`):
each parameter once (tied weights listed once), ``ignored_params`` checked against the
module, the reduce op checked (``"avg"``, torch DDP's, or ``"sum"``), and one broadcast per
dtype and device from the group's first rank at construction, as torch DDP's
``_sync_module_states`` does.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ... import comm

__all__ = ["unique_parameters", "check_reduce_op", "ignored_ids", "REDUCE_OPS"]

REDUCE_OPS = ("avg", "sum")


def unique_parameters(module: nn.Module, ignored: Iterable = ()) -> list:
    """(name, parameter) pairs that need gradients, tied weights listed once, ``ignored``
    parameters left out."""
    skip = {id(p) for p in ignored}
    seen, out = set(), []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen and id(p) not in skip:
            seen.add(id(p))
            out.append((name, p))
    return out


def check_reduce_op(reduce_op: str) -> str:
    """``"avg"`` or ``"sum"``, else ``ValueError``."""
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"reduce_op must be 'avg' (mean over ranks, as torch DDP/FSDP) or "
                         f"'sum' (plain sum: divide the loss by the global token count), "
                         f"got {reduce_op!r}")
    return reduce_op


def ignored_ids(module: nn.Module, ignored_params: Iterable) -> set:
    """``id`` s of ``ignored_params``, each checked to be a parameter of ``module``.

    Raises:
        ValueError: one of them is not a parameter of ``module``.
    """
    ignored = list(ignored_params or ())
    mine = {id(p) for p in module.parameters()}
    stray = [i for i, p in enumerate(ignored) if id(p) not in mine]
    if stray:
        raise ValueError(f"ignored_params: entries {stray} of {len(ignored)} are not "
                         f"parameters of the wrapped module")
    return {id(p) for p in ignored}


def _broadcast_parameters(params: list, src: int, group, axis: str) -> None:
    """Copy every parameter from global rank ``src`` to the group in one broadcast per
    dtype and device (a flat buffer, as torch DDP's ``_sync_module_states`` coalesces):
    on a warm pool a slider's re-run pays one collective's latency, not one per tensor.
    Bytes: the parameters' bytes per hop, as per-tensor broadcasts would send."""
    by_kind: dict = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    me = torch.distributed.get_rank()
    with torch.no_grad():
        for ps in by_kind.values():
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            comm.broadcast(flat, src, group, axis=axis)
            if me == src:
                continue
            offset = 0
            for p in ps:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n
