"""Data parallelism written from labkit's traced all-reduce.

Every rank holds the whole model and a 1/N slice of the global batch. Because each rank's
loss is the mean over its slice, the *average* of the ranks' gradients equals the gradient
of the mean loss over the global batch, so one optimizer step matches single-process
training on that batch (lecture claim C8). The cost is one all-reduce of the gradients per
step, 2(N−1)/N·|θ| bytes per rank on a ring (claim C9). With ``reduce_op="sum"`` the ranks'
gradients are summed instead: the rule when each rank's loss is already divided by the
*global* token count.

Two modes:

* ``"naive"`` — after backward, all-reduce every gradient, one call per parameter.
* ``"ddp"`` — the PyTorch DDP design (Li et al. 2020, "PyTorch Distributed", §3.2):
  parameters are packed into buckets in reverse registration order (roughly the order
  backward produces their gradients); when the last gradient of a bucket is accumulated, a
  post-accumulate hook copies the bucket into a flat buffer and launches an async
  all-reduce, so communication overlaps the rest of backward. Buckets go out in index order
  on every rank (:mod:`labkit.parallel.dp.ordered`): a ready bucket waits for the earlier
  ones, since a rank whose backward runs in another order would otherwise pair its bucket
  0 with another rank's bucket 1.

Gradient accumulation, any pattern: ``no_sync()`` (or ``require_sync = False``) keeps the
hooks quiet and gradients accumulate locally; a synced backward all-reduces each bucket's
*whole* local accumulation; ``finish_gradient_sync()`` (re)sends, in bucket order, every
bucket not sent since its gradients last changed — found by each gradient's identity and
in-place version, so gradients written without any hook firing (a weight-gradient pass
that sets ``.grad`` itself) are synced too. The result is always the mean (or sum) over
ranks of each rank's summed microbatch gradients.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from ... import comm
from .ordered import CollectiveProgram, at_end_of_backward, grad_stamp, same_stamp
# moved out (importable from here as before): the parameter helpers, and PyTorch's DDP
from .params import (REDUCE_OPS, _broadcast_parameters, check_reduce_op,  # noqa: F401
                     ignored_ids, unique_parameters)
from .torch_ddp import torch_ddp  # noqa: F401

__all__ = ["DataParallel", "unique_parameters", "torch_ddp", "check_reduce_op",
           "ignored_ids"]


class _Bucket:
    def __init__(self, index: int, params: list, device, dtype):
        self.index, self.params = index, params
        self.offsets = []
        n = 0
        for _, p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, device=device, dtype=dtype)
        self.ready: set = set()            # params whose hook fired in this synced backward
        self.handle: Optional[comm.Handle] = None
        self.stamps: Optional[list] = None  # the gradients it last sent (None: not this step)

    def __repr__(self) -> str:
        return f"bucket {self.index}"

    def stale(self) -> bool:
        """Not sent this step, or a gradient changed since it was."""
        return self.stamps is None or not all(
            same_stamp(s, p.grad) for s, (_, p) in zip(self.stamps, self.params))


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``group``.

    Args:
        module: the model; every rank must build it identically (parameters are also
            broadcast from the group's first rank at construction, as torch DDP does).
        group: process group of the data-parallel ranks (``None``: the default group).
        mode: ``"ddp"`` (bucketed, overlapped) or ``"naive"`` (per-parameter, after backward).
        bucket_mb: bucket capacity in MiB for ``"ddp"`` (torch DDP's default is 25).
        find_unused: a parameter that got no gradient on this rank (``.grad is None`` at
            ``finish_gradient_sync``) contributes zeros instead of raising; one that got
            none on *every* rank keeps ``.grad`` untouched (``None``), so the optimizer
            skips it — torch DDP's ``find_unused_parameters=True`` (its reducer all-reduces
            a used-map and leaves globally unused gradients alone). Costs one extra
            all-reduce of one float per parameter per step, as torch's.
        axis: mesh axis name stamped on the trace events.
        reduce_op: ``"avg"`` (mean over ranks, torch DDP's) or ``"sum"``.
        ignored_params: parameters this wrapper leaves alone — no broadcast, no hook, no
            bucket, their ``.grad`` untouched (e.g. expert weights that a second wrapper
            reduces over another group).

    Usage per step: forward and backward per microbatch (any of them under ``no_sync()``),
    then ``finish_gradient_sync()``, then the optimizer step, then zero the gradients.

    Raises:
        ValueError: unknown mode or reduce op, non-positive bucket size, an ignored
            parameter that is not the module's.
    """

    def __init__(self, module: nn.Module, group=None, mode: str = "ddp",
                 bucket_mb: float = 25.0, find_unused: bool = False, axis: str = "dp", *,
                 reduce_op: str = "avg", ignored_params: Iterable = ()):
        super().__init__()
        if mode not in ("ddp", "naive"):
            raise ValueError(f"DataParallel mode must be 'ddp' or 'naive', got {mode!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.reduce_op = check_reduce_op(reduce_op)
        ignored = ignored_ids(module, ignored_params)
        self.module, self.group, self.mode, self.axis = module, group, mode, axis
        self.find_unused = find_unused
        self.world = comm.group_size(group)
        self.require_sync = True
        self.params = [(n, p) for n, p in unique_parameters(module) if id(p) not in ignored]
        _broadcast_parameters([p for _, p in self.params], comm.group_ranks(group)[0], group,
                              axis)
        self.buckets: list[_Bucket] = []
        self._round: Optional[CollectiveProgram] = None
        self._synced: Optional[list] = None
        if mode == "ddp":
            self._build_buckets(int(bucket_mb * 2**20))
            for b in self.buckets:
                for i, (_, p) in enumerate(b.params):
                    p.register_post_accumulate_grad_hook(self._make_hook(b, i))

    @property
    def bucket_bytes(self) -> int:
        """Bytes held by the flat bucket buffers (memory category "other")."""
        return sum(comm.nbytes(b.buffer) for b in self.buckets)

    def _build_buckets(self, cap: int) -> None:
        current: list = []
        size = 0
        for name, p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap or p.dtype != current[0][1].dtype):
                self._add_bucket(current)
                current, size = [], 0
            current.append((name, p))
            size += nbytes
        if current:
            self._add_bucket(current)

    def _add_bucket(self, params) -> None:
        p0 = params[0][1]
        self.buckets.append(_Bucket(len(self.buckets), params, p0.device, p0.dtype))

    def _make_hook(self, bucket: _Bucket, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self.require_sync:
                return
            if self._round is None:  # first gradient of a synced backward: a new round
                self._round = CollectiveProgram(self.buckets, self._launch)
                at_end_of_backward(self._end_round)
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params) and not self._round.issued(bucket):
                self._round.mark_ready(bucket)
        return hook

    def _end_round(self) -> None:
        """End of a synced backward: buckets not sent yet wait for the next round or for
        ``finish_gradient_sync`` (in flight ones keep running under the next forward)."""
        self._round = None
        for b in self.buckets:
            b.ready = set()

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.handle is not None:  # superseded: its buffer is about to be refilled
            bucket.handle.wait()
        for (_, p), off in zip(bucket.params, bucket.offsets):
            dst = bucket.buffer[off:off + p.numel()]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
        bucket.stamps = [grad_stamp(p.grad) for _, p in bucket.params]
        bucket.handle = comm.all_reduce(bucket.buffer, op=self.reduce_op, group=self.group,
                                        axis=self.axis, async_op=True, bucket=bucket.index)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; no communication until the context exits."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def finish_gradient_sync(self) -> None:
        """Complete the all-reduces and leave the mean (``reduce_op="sum"``: the sum) over
        ranks of each rank's accumulated gradient in every ``p.grad``.

        Raises:
            RuntimeError: a parameter received no gradient this step and ``find_unused`` is
                off (the message names it; raised on every rank alike, before any
                mismatched collective, so nothing hangs); or the gradients are exactly
                those the previous call left (a second sync would divide, or with ``"sum"``
                multiply, them again).
        """
        if self._round is not None:
            self._end_round()
        self._refuse_repeat()
        if self.mode == "naive":
            self._missing([n for n, p in self.params if p.grad is None])
            used = self._used_anywhere()
            for _, p in self.params:
                if id(p) not in used:
                    continue  # no rank used it: its gradient stays None, as torch DDP's
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, op=self.reduce_op, group=self.group, axis=self.axis)
        else:
            todo = [b for b in self.buckets if b.stale()]
            self._missing([n for b in todo for n, p in b.params if p.grad is None])
            for b in todo:  # in bucket order, like the rounds
                self._launch(b)
            used = self._used_anywhere()  # after every bucket went out: one order everywhere
            for b in self.buckets:
                b.handle.wait()
                for (_, p), off in zip(b.params, b.offsets):
                    view = b.buffer[off:off + p.numel()].view_as(p)
                    if id(p) not in used:
                        continue  # no rank used it: its gradient stays None, as torch DDP's
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
                b.handle, b.stamps = None, None
        self._synced = [grad_stamp(p.grad) for _, p in self.params]

    def _used_anywhere(self) -> set:
        """``id`` s of the parameters some rank produced a gradient for this step. Without
        ``find_unused`` every parameter has one (``_missing`` raised otherwise); with it,
        the ranks all-reduce a used-map (one float per parameter), as torch DDP's reducer
        does, so a parameter no rank used keeps ``grad=None`` on every rank."""
        if not self.find_unused:
            return {id(p) for _, p in self.params}
        if not self.params:
            return set()
        flags = torch.tensor([float(p.grad is not None) for _, p in self.params],
                             device=self.params[0][1].device)
        comm.all_reduce(flags, op="sum", group=self.group, axis=self.axis, used_map=True)
        return {id(p) for (_, p), f in zip(self.params, flags.tolist()) if f > 0}

    def _refuse_repeat(self) -> None:
        if self.params and self._synced is not None and all(
                same_stamp(s, p.grad) for s, (_, p) in zip(self._synced, self.params)):
            raise RuntimeError(
                "data parallel: finish_gradient_sync() again on the gradients the previous "
                "call left; zero the gradients and run a backward first")

    def _missing(self, names: list[str]) -> None:
        if names and not self.find_unused:
            for b in self.buckets:  # drain launched buckets so the group stays consistent
                if b.handle is not None:
                    b.handle.wait()
                b.handle, b.stamps = None, None
            raise RuntimeError(
                f"data parallel: parameter(s) {', '.join(names)} received no gradient this "
                f"step, so their bucket can never be all-reduced. Use them in the forward "
                f"pass, freeze them (requires_grad=False), or pass find_unused=True (torch "
                f"DDP: find_unused_parameters=True): this rank then contributes zeros, and a "
                f"parameter no rank used keeps grad None.")
