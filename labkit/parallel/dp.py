"""Data parallelism written from labkit's traced all-reduce.

Every rank holds the whole model and a 1/N slice of the global batch. Because each rank's
loss is the mean over its slice, the *average* of the ranks' gradients equals the gradient
of the mean loss over the global batch, so one optimizer step matches single-process
training on that batch (lecture claim C8). The cost is one all-reduce of the gradients per
step, 2(N−1)/N·|θ| bytes per rank on a ring (claim C9).

Two modes:

* ``"naive"`` — after backward, all-reduce every gradient, one call per parameter.
* ``"ddp"`` — the PyTorch DDP design (Li et al. 2020, "PyTorch Distributed", §3.2):
  parameters are packed into buckets in reverse registration order (roughly the order
  backward produces their gradients); when the last gradient of a bucket is accumulated, a
  post-accumulate hook copies the bucket into a flat buffer and launches an async
  all-reduce, so communication overlaps the rest of backward.

Gradient accumulation: inside ``no_sync()`` hooks do nothing and gradients accumulate
locally; the all-reduce runs once, in the last microbatch's backward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from .. import comm

__all__ = ["DataParallel", "unique_parameters", "torch_ddp"]


def unique_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs that need gradients, tied weights listed once."""
    seen, out = set(), []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


class _Bucket:
    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], device, dtype):
        self.index = index
        self.params = params
        self.offsets = []
        n = 0
        for _, p in params:
            self.offsets.append(n)
            n += p.numel()
        self.buffer = torch.zeros(n, device=device, dtype=dtype)
        self.ready: set[int] = set()
        self.handle: Optional[comm.Handle] = None


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``group``.

    Args:
        module: the model; every rank must build it identically (parameters are also
            broadcast from the group's first rank at construction, as torch DDP does).
        group: process group of the data-parallel ranks (``None``: the default group).
        mode: ``"ddp"`` (bucketed, overlapped) or ``"naive"`` (per-parameter, after backward).
        bucket_mb: bucket capacity in MiB for ``"ddp"`` (torch DDP's default is 25).
        find_unused: if a parameter got no gradient in a step, all-reduce zeros for it
            instead of raising.
        axis: mesh axis name stamped on the trace events.

    Usage per step: forward and backward (under ``no_sync()`` for all but the last
    microbatch), then ``finish_gradient_sync()``, then the optimizer step.

    Raises:
        ValueError: unknown mode or non-positive bucket size.
    """

    def __init__(self, module: nn.Module, group=None, mode: str = "ddp",
                 bucket_mb: float = 25.0, find_unused: bool = False, axis: str = "dp"):
        super().__init__()
        if mode not in ("ddp", "naive"):
            raise ValueError(f"DataParallel mode must be 'ddp' or 'naive', got {mode!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.module, self.group, self.mode, self.axis = module, group, mode, axis
        self.find_unused = find_unused
        self.world = comm.group_size(group)
        self.require_sync = True
        self.params = unique_parameters(module)
        src = comm.group_ranks(group)[0]
        with torch.no_grad():
            for _, p in self.params:
                comm.broadcast(p.data, src, group, axis=axis)
        self.buckets: list[_Bucket] = []
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
            bucket.ready.add(i)
            if len(bucket.ready) == len(bucket.params):
                self._launch(bucket)
        return hook

    def _launch(self, bucket: _Bucket) -> None:
        for (_, p), off in zip(bucket.params, bucket.offsets):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            bucket.buffer[off:off + p.numel()].copy_(g.reshape(-1))
        bucket.handle = comm.all_reduce(bucket.buffer, group=self.group, axis=self.axis,
                                        async_op=True, bucket=bucket.index)

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
        """Complete the all-reduce and leave the mean gradient in every ``p.grad``.

        Raises:
            RuntimeError: a parameter received no gradient this step and ``find_unused`` is
                off; the message names it. Raised on every rank alike, before any
                mismatched collective, so nothing hangs.
        """
        if self.mode == "naive":
            self._missing([n for n, p in self.params if p.grad is None])
            for _, p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, op="avg", group=self.group, axis=self.axis)
            return
        missing = [b for b in self.buckets if b.handle is None]
        if missing:
            names = [b.params[i][0] for b in missing for i in range(len(b.params))
                     if i not in b.ready]
            self._missing(names)
            for b in missing:  # find_unused: sync zeros for the unused ones
                self._launch(b)
        for b in self.buckets:
            b.handle.wait()
            b.buffer.div_(self.world)
            for (_, p), off in zip(b.params, b.offsets):
                view = b.buffer[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
            b.handle, b.ready = None, set()

    def _missing(self, names: list[str]) -> None:
        if names and not self.find_unused:
            for b in self.buckets:  # drain launched buckets so the group stays consistent
                if b.handle is not None:
                    b.handle.wait()
                    b.handle, b.ready = None, set()
            raise RuntimeError(
                f"data parallel: parameter(s) {', '.join(names)} received no gradient this "
                f"step, so their bucket can never be all-reduced. Use them in the forward "
                f"pass, freeze them (requires_grad=False), or pass find_unused=True to "
                f"all-reduce zeros for them (torch DDP: find_unused_parameters=True).")


def torch_ddp(module: nn.Module, group=None, bucket_mb: float = 25.0,
              find_unused: bool = False) -> nn.Module:
    """PyTorch's ``DistributedDataParallel`` with a comm hook routed through labkit.comm,
    so its bucket all-reduces are traced and counted like labkit's own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module, process_group=group, bucket_cap_mb=bucket_mb,
              find_unused_parameters=find_unused)
    world = comm.group_size(group)

    def hook(state, bucket):
        buf = bucket.buffer()
        handle = comm.all_reduce(buf, group=group, axis="dp", async_op=True, impl="torch-ddp")

        def done(fut):
            handle.complete()
            return fut.value()[0].div_(world)
        return handle.work.get_future().then(done)

    ddp.register_comm_hook(None, hook)
    return ddp
