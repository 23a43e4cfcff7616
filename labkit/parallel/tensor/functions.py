"""Megatron's conjugate communication operators as autograd Functions.

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, §3, Fig. 3) brackets each parallel
region with two operators that are each other's transpose:

==========================================  ===================  =======================
Function                                    forward              backward
==========================================  ===================  =======================
:class:`IdentityFwdAllReduceBwd` (``f``)    identity             all-reduce (sum)
:class:`AllReduceFwdIdentityBwd` (``g``)    all-reduce (sum)     identity
:class:`AllGatherFwdReduceScatterBwd`       all-gather on dim 1  reduce-scatter on dim 1
:class:`ReduceScatterFwdAllGatherBwd`       reduce-scatter dim 1 all-gather on dim 1
==========================================  ===================  =======================

The last two are sequence parallelism's ``g`` and ``ḡ`` (Korthikanti et al. 2022, §4.2.2,
Fig. 5): the residual stream between blocks holds ``(B, S/T, H)`` and the sequence is gathered
only for the column-parallel matmuls. An all-reduce is a reduce-scatter followed by an
all-gather, so the pair moves the same bytes as ``f``/``g``.

Every transfer goes through :mod:`labkit.comm` (traced; ``axis="tp"``), with ``tags`` (for
example ``layer=3, site="attn_in"``) and ``phase`` (``"forward"``/``"backward"``) stored on
the trace event, so measurements can attribute bytes to a block, a site and a pass. A
degree-1 group (``group=None``) communicates nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ... import comm

__all__ = ["IdentityFwdAllReduceBwd", "AllReduceFwdIdentityBwd", "AllGatherFwdReduceScatterBwd",
           "ReduceScatterFwdAllGatherBwd", "tp_size", "tp_rank", "gather_seq", "scatter_seq",
           "start_gather_seq", "start_scatter_seq", "copy_to_tp", "reduce_from_tp",
           "gather_from_sp", "reduce_scatter_to_sp"]

AXIS = "tp"


def tp_size(group) -> int:
    """Ranks in the tensor-parallel ``group``; ``None`` means degree 1."""
    return 1 if group is None else comm.group_size(group)


def tp_rank(group) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    import torch.distributed as dist

    return 0 if group is None else dist.get_rank(group)


def _fwd(tags: dict) -> dict:
    return {**tags, "phase": "forward"}


def _bwd(tags: dict) -> dict:
    return {**tags, "phase": "backward"}


def _all_reduce(x: torch.Tensor, group, tags: dict) -> torch.Tensor:
    # a fresh contiguous buffer: autograd may hand the same gradient tensor to several
    # consumers (a residual add passes one tensor to both branches), so never reduce in place
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group, axis=AXIS, **tags)
    return out


def gather_seq(x: torch.Tensor, group, tags: Optional[dict] = None) -> torch.Tensor:
    """All-gather ``x`` ``(B, s, …)`` along dim 1 over ``group`` → ``(B, T·s, …)``, rank order.

    ``comm.all_gather`` concatenates along dim 0, so the pieces land as ``(T, B, s, …)`` and
    one copy puts the sequence back in dim 1. Bytes: (T−1)/T · |output|.
    """
    return start_gather_seq(x, group, tags)()


def start_gather_seq(x: torch.Tensor, group, tags: Optional[dict] = None
                     ) -> Callable[[], torch.Tensor]:
    """Issue :func:`gather_seq` asynchronously; returns ``done()``, which waits for it and
    returns the gathered ``(B, T·s, …)``. In between the collective runs on the backend's
    own thread (gloo) or stream (NCCL), so the caller's compute overlaps it."""
    n = tp_size(group)
    if n == 1:
        return lambda: x
    x = x.contiguous()
    b, s, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    # gloo wants dim 0 of the output to be N x dim 0 of the input
    buf = torch.empty((n * b, s) + rest, dtype=x.dtype, device=x.device)
    handle = comm.all_gather(buf, x, group=group, axis=AXIS, async_op=True, **(tags or {}))
    held = [buf]

    def done() -> torch.Tensor:
        handle.wait()  # views of the buffer only after the wait (labkit.comm.Handle)
        out = held.pop().view(n, b, s, *rest).transpose(0, 1).reshape(b, n * s, *rest)
        return out  # the buffer is freed here, as by the synchronous call, not with done
    return done


def scatter_seq(x: torch.Tensor, group, tags: Optional[dict] = None) -> torch.Tensor:
    """Reduce-scatter ``x`` ``(B, S, …)`` along dim 1 (sum over ``group``) → ``(B, S/T, …)``:
    rank ``r`` keeps tokens ``[r·S/T, (r+1)·S/T)``. Bytes: (T−1)/T · |input|.

    Raises:
        ValueError: ``S`` not divisible by the group size.
    """
    return start_scatter_seq(x, group, tags)()


def start_scatter_seq(x: torch.Tensor, group, tags: Optional[dict] = None
                      ) -> Callable[[], torch.Tensor]:
    """Issue :func:`scatter_seq` asynchronously; returns ``done()``, which waits for it and
    returns this rank's ``(B, S/T, …)`` (same errors, raised at issue)."""
    n = tp_size(group)
    if n == 1:
        return lambda: x
    b, s = x.shape[0], x.shape[1]
    if s % n:
        raise ValueError(f"sequence parallelism: sequence length {s} does not divide by "
                         f"tp={n}")
    rest = tuple(x.shape[2:])
    pieces = x.reshape(b, n, s // n, *rest).transpose(0, 1).reshape(n * b, s // n, *rest)
    out = torch.empty((b, s // n) + rest, dtype=x.dtype, device=x.device)
    handle = comm.reduce_scatter(out, pieces, group=group, axis=AXIS, async_op=True,
                                 **(tags or {}))
    held = [pieces]  # in flight: kept until the wait, then freed there (labkit.comm_release)

    def done() -> torch.Tensor:
        handle.wait()
        held.clear()
        return out
    return done


class IdentityFwdAllReduceBwd(torch.autograd.Function):
    """Megatron's ``f`` (Shoeybi et al. 2019, §3, Fig. 3a): the input of a column-parallel
    region. Forward returns ``x`` unchanged (any shape); backward sums the gradient over the
    tp group, because every rank's partial input-gradient covers only its column shard.

    Also used on *weights* that every tp rank holds whole but uses in part (sequence-parallel
    norm weights, replicated grouped-query K/V projections): the all-reduce in backward leaves
    the full, summed gradient on every rank, so no step after backward is needed."""

    @staticmethod
    def forward(ctx, x, group, tags):
        ctx.group, ctx.tags = group, tags
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, _bwd(ctx.tags)), None, None


class AllReduceFwdIdentityBwd(torch.autograd.Function):
    """Megatron's ``g`` (Shoeybi et al. 2019, §3, Fig. 3a): the output of a row-parallel
    region. Forward sums the ranks' partial outputs (any shape); backward passes the
    gradient through, since every rank's copy of the output feeds identical computation."""

    @staticmethod
    def forward(ctx, x, group, tags):
        return _all_reduce(x, group, _fwd(tags))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class AllGatherFwdReduceScatterBwd(torch.autograd.Function):
    """Sequence parallelism's ``g`` (Korthikanti et al. 2022, §4.2.2, Fig. 5): the
    sequence-sharded ``(B, S/T, H)`` input of a column-parallel region is gathered to
    ``(B, S, H)``; in backward each rank's full-sequence input gradient is partial, so it is
    summed and scattered back to the rank's ``S/T`` tokens."""

    @staticmethod
    def forward(ctx, x, group, tags):
        ctx.group, ctx.tags = group, tags
        return gather_seq(x, group, _fwd(tags))

    @staticmethod
    def backward(ctx, grad):
        return scatter_seq(grad, ctx.group, _bwd(ctx.tags)), None, None


class ReduceScatterFwdAllGatherBwd(torch.autograd.Function):
    """Sequence parallelism's ``ḡ`` (Korthikanti et al. 2022, §4.2.2, Fig. 5): the partial
    ``(B, S, H)`` output of a row-parallel region is summed and scattered to ``(B, S/T, H)``;
    backward gathers the sequence-sharded gradient back to the full sequence."""

    @staticmethod
    def forward(ctx, x, group, tags):
        ctx.group, ctx.tags = group, tags
        return scatter_seq(x, group, _fwd(tags))

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.group, _bwd(ctx.tags)), None, None


def copy_to_tp(x: torch.Tensor, group, **tags) -> torch.Tensor:
    """``f``: identity forward, all-reduce backward (no-op for degree 1)."""
    return x if tp_size(group) == 1 else IdentityFwdAllReduceBwd.apply(x, group, tags)


def reduce_from_tp(x: torch.Tensor, group, **tags) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward (no-op for degree 1)."""
    return x if tp_size(group) == 1 else AllReduceFwdIdentityBwd.apply(x, group, tags)


def gather_from_sp(x: torch.Tensor, group, **tags) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward (degree 1: no-op)."""
    return x if tp_size(group) == 1 else AllGatherFwdReduceScatterBwd.apply(x, group, tags)


def reduce_scatter_to_sp(x: torch.Tensor, group, **tags) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward (degree 1: no-op)."""
    return x if tp_size(group) == 1 else ReduceScatterFwdAllGatherBwd.apply(x, group, tags)
