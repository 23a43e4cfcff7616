"""Where the tensors of a training step live, and whether the host reads their values,
checked on one rank of any layout in one process with no GPU: the rank's device is torch's
``meta`` device.

A rank on a GPU must create every tensor of its step on its device: a tensor made on the
CPU inside the job either fails there ("expected all tensors on the same device") or,
worse, runs on the CPU and copies. ``meta`` is a device other than the CPU that any torch
build has, with no storage, so labkit's job runs on it for one rank of a cluster-scale
layout under torch's fake process group (collectives return at once), and a tensor put on
the CPU by mistake shows up exactly as it would on ``cuda``. What it cannot show is what
only CUDA has (autocast's CUDA op lists, the allocator, NCCL): torch's CPU-only build
cannot even index a fake CUDA tensor (every CUDA device guard raises "PyTorch is not linked
with support for cuda devices"), so those wait for a GPU (``benchmarks/gpu_check.py``).

:func:`cpu_tensors_in_step` returns every operator that produced a CPU tensor inside the
step function (the build before it and the bookkeeping after it are not counted). Host
tensors that belong on the host are not counted: torch's AdamW keeps its step counters on
the host unless fused or capturable, and 0-d CPU scalars are torch's way of passing a
Python number.
"""
from __future__ import annotations

import traceback
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StepDone(Exception):
    """Raised after the watched step: what follows (reading the losses) is bookkeeping on
    the host, not part of the step, and ``meta`` tensors have no values to read."""


class _CpuOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cpu = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
               and t.device.type == "cpu" and t.dim() > 0]
        if cpu:
            stack = traceback.extract_stack()[:-1]
            # the input pipeline reads the corpus on the host and copies the batch over,
            # as any trainer does; AdamW's host step counters are torch's design
            if not any("/torch/optim/" in f.filename or f.name == "rank_batch"
                       for f in stack):
                here = [f for f in stack if "/labkit/" in f.filename]
                where = f"{here[-1].filename.split('/labkit/')[-1]}:{here[-1].lineno}" \
                    if here else "?"
                self.found.append((str(func), tuple(cpu[0].shape), where))
        return out


def cpu_tensors_in_step(cfg, rank: int = 0) -> dict:
    """Run one step of ``cfg`` (a :class:`labkit.config.RunConfig`, fp32: autocast has no
    ``meta`` device) on rank ``rank`` with its tensors on ``meta``.

    Returns:
        ``{"cpu_ops": [(operator, shape, labkit file:line)], "devices": {the devices of
        the parameters the optimizer steps}}``.

    Raises:
        RuntimeError: an operator mixed devices (a CPU tensor met a ``meta`` one), or the
            host read a value (``.item()``, ``float(t)``, ``.tolist()``: none on ``meta``).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit import train
    from labkit.measure import fake_rank as fr
    from labkit.train import step as step_mod

    cfg = replace(cfg, steps=1, measure_memory=False, count_flops=False)
    world = cfg.parallel.world_size
    found, devices = [], set()
    make = step_mod.make_step

    def watched_make_step(setup, *args, **kwargs):
        fn = make(setup, *args, **kwargs)
        devices.update(str(p.device) for g in setup.opt.param_groups for p in g["params"])

        def watched(s, mark):
            with _CpuOutputs() as mode:
                out = fn(s, mark)
            found.extend(mode.found)
            raise _StepDone
        watched.__dict__.update(fn.__dict__)  # what the job reads off its step (step.sdc)
        return watched

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank,
                            world_size=world)
    try:
        ctx = fr._context(rank, world)
        ctx.device = torch.device("meta")
        with mock.patch.object(train, "make_step", watched_make_step):
            train.run(ctx, cfg)
    except _StepDone:
        pass
    finally:
        dist.destroy_process_group()
    return {"cpu_ops": found, "devices": devices}
