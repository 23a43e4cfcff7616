"""Host reads inside a training step, counted on one rank of any layout in one process.

On a GPU every read of a tensor's value by the host (``.item()``, ``.tolist()``,
``float(t)``, ``bool(t)``: torch's ``aten._local_scalar_dense``) waits for the device to
finish all the work queued so far: the CPU stops launching kernels until the GPU drains,
and a pipeline or an overlapped collective loses its overlap. The count is the same on the
CPU, where each read costs nothing, so it is checked here without a GPU.

:func:`step_syncs` runs ``labkit.train.run`` for one rank of ``cfg`` under fake tensors and
torch's fake process group (:mod:`labkit.measure.fake_rank`'s machinery: no storage, no
other process, any world size) and counts the reads made inside each step function call
(the build before and the bookkeeping after the steps are not counted).
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR = torch.ops.aten._local_scalar_dense.default


class _Reads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls; remembers where each came from."""

    def __init__(self):
        super().__init__()
        self.count, self.where = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR:
            import traceback

            stack = traceback.extract_stack()[:-1]
            # AdamW's step counters: host tensors unless the optimizer is fused or
            # capturable, so reading them makes no one wait for the device
            # and checks that run only when the tensor is on the host (functions named
            # ``*_cpu``) read no device value on a GPU
            if any("/torch/optim/" in f.filename or f.name.endswith("_cpu") for f in stack):
                return func(*args, **(kwargs or {}))
            self.count += 1
            frames = [f for f in stack if "/labkit/" in f.filename]
            if frames:
                f = frames[-1]
                self.where.append(f"{f.filename.split('/labkit/')[-1]}:{f.lineno}")
        return func(*args, **(kwargs or {}))


def step_syncs(cfg, rank: int = 0, steps: int = 1) -> dict:
    """``{"per_step": [reads in step 0, 1, …], "where": [file:line of each read]}`` for
    rank ``rank`` of ``cfg`` (a :class:`labkit.config.RunConfig`), run for ``steps`` steps
    without memory tracking or FLOP counting."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit import train
    from labkit.measure import fake_rank as fr
    from labkit.train import step as step_mod

    cfg = replace(cfg, steps=steps, measure_memory=False, count_flops=False)
    world = cfg.parallel.world_size
    per_step, where = [], []
    make = step_mod.make_step

    def counted_make_step(*args, **kwargs):
        fn = make(*args, **kwargs)

        def counted(s, mark):
            with _Reads() as reads:
                out = fn(s, mark)
            per_step.append(reads.count)
            where.extend(reads.where)
            return out
        return counted

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ctx = fr._context(rank, world)
        with warnings.catch_warnings(), fr._p2p_holds_tensors(), fr._fake_mode(), \
                mock.patch.object(train, "make_step", counted_make_step):
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            train.run(ctx, cfg)
    finally:
        dist.destroy_process_group()
    return {"per_step": per_step, "where": sorted(set(where))}
