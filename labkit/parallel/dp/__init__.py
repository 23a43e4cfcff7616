"""Data parallelism written from labkit's traced all-reduce (claims C8, C9).

* :mod:`.ddp` — :class:`DataParallel` (naive per-parameter all-reduce, or PyTorch DDP's
  buckets overlapped with backward);
* :mod:`.torch_ddp` — :func:`torch_ddp`, PyTorch's own DDP routed through labkit.comm as
  the reference;
* :mod:`.params` — the parameters a wrapper handles (tied ones once, ignored ones
  checked), the reduce op, the broadcast that starts the ranks equal (shared with ZeRO);
* :mod:`.ordered` — collectives issued in one fixed order on every rank whatever order
  autograd produces gradients in (shared with ZeRO, :mod:`labkit.parallel.zero`).
"""
from .ddp import DataParallel
from .params import check_reduce_op, ignored_ids, unique_parameters
from .torch_ddp import torch_ddp

__all__ = ["DataParallel", "torch_ddp", "unique_parameters", "check_reduce_op", "ignored_ids"]
