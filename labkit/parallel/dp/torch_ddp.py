"""PyTorch's own ``DistributedDataParallel``, its bucket all-reduces routed through
labkit.comm: the reference :class:`~.ddp.DataParallel` is compared with, traced and counted
alike."""
from __future__ import annotations

from torch import nn

from ... import comm

__all__ = ["torch_ddp"]


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
