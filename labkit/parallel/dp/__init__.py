"""Data parallelism written from labkit's traced all-reduce (claims C8, C9).

* :mod:`.ddp` — :class:`DataParallel` (naive per-parameter all-reduce, or PyTorch DDP's
  buckets overlapped with backward) and :func:`torch_ddp`, PyTorch's own DDP routed through
  labkit.comm as the reference;
* :mod:`.ordered` — collectives issued in one fixed order on every rank whatever order
  autograd produces gradients in (shared with ZeRO, :mod:`labkit.parallel.zero`).
"""
from .ddp import (DataParallel, check_reduce_op, ignored_ids, torch_ddp,
                  unique_parameters)

__all__ = ["DataParallel", "torch_ddp", "unique_parameters", "check_reduce_op", "ignored_ids"]
