"""Tensor-parallel step timing job for ``benchmarks/tp_vs_torch.py``: labkit's layers or
PyTorch's ``parallelize_module`` on the same model, batch and optimizer."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.config import ModelConfig
from labkit.models import build_model


@dataclass(frozen=True)
class TPBench:
    model: ModelConfig
    impl: str = "labkit"      # or "torch"
    sp: bool = False
    batch: int = 8
    steps: int = 8
    threads: int = 1


def tp_step_times(ctx, cfg: TPBench) -> dict:
    """Seconds per training step (forward, vocab-parallel loss, backward, AdamW) on this rank;
    every step starts at a barrier, so the slowest rank's time is the step's."""
    torch.set_num_threads(cfg.threads)
    model = build_model(cfg.model, seed=0)
    if cfg.impl == "labkit":
        from labkit.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, ctx.group, sequence_parallel=cfg.sp)
        loss_fn, scope = model.loss, _Null
    else:
        from torch.distributed.device_mesh import DeviceMesh

        from labkit.parallel.tensor.torch_tp import (torch_loss, torch_loss_context,
                                                     torch_tensor_parallel)
        torch_tensor_parallel(model, DeviceMesh.from_group(ctx.group, "cpu"),
                              sequence_parallel=cfg.sp)
        loss_fn, scope = torch_loss, torch_loss_context
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    v, s = cfg.model.vocab_size, cfg.model.seq_len
    times, losses = [], []
    for step in range(cfg.steps):
        x = torch.randint(0, v, (cfg.batch, s), generator=g)
        y = torch.randint(0, v, (cfg.batch, s), generator=g)
        dist.barrier(ctx.group)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with scope():
            loss = loss_fn(model(x), y, "mean")
            loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return {"step_times": times, "losses": losses}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
