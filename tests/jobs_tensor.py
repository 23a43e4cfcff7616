"""Jobs for the tensor-parallel tests (importable by the ranks: tests/ is on their path)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from labkit.config import ModelConfig
from labkit.models import build_model


@dataclass(frozen=True)
class TPRun:
    """One tensor-parallel training run: ``steps`` AdamW steps on ``batch(step)``."""

    model: ModelConfig
    tp: int = 2
    sp: bool = False
    regather: bool = False
    impl: str = "labkit"          # or "torch" (parallelize_module)
    as_stage: bool = False        # convert StageModule(gpt, 0, 1) instead of the GPT
    steps: int = 3
    batch: int = 2
    seq: Optional[int] = None     # default model.seq_len
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.1
    # AdamW's m/(sqrt(v)+eps) turns the rounding noise of a gradient element near zero into
    # a whole lr step: at eps=1e-8 one process in fp32 and in fp64 already differ by 1.2e-4
    # after 3 steps on one of these models; 1e-6 keeps the check about parallelism
    eps: float = 1e-6
    mutant: str = ""              # a planted bug, to see the parity tests fail
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def batch(run: TPRun, step: int) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    s = run.seq or run.model.seq_len
    v = run.model.vocab_size
    x = torch.randint(0, v, (run.batch, s), generator=g)
    y = torch.randint(0, v, (run.batch, s), generator=g)
    return x, y


def reference(run: TPRun) -> dict:
    """One process, the full model: losses, step-0 gradients, parameters after the steps."""
    torch.set_num_threads(1)
    model = build_model(run.model, seed=run.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay,
                            eps=run.eps)
    losses, grads = [], None
    for step in range(run.steps):
        x, y = batch(run, step)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _plant(mutant: str) -> None:
    """Swap in a wrong piece of labkit's tensor parallelism, in this rank process only."""
    from labkit.parallel.tensor import cross_entropy, functions, layers, vocab

    if mutant == "no_sp_norm_grad_sum":
        layers.copy_to_tp = lambda x, group, **tags: x
    elif mutant == "wrong_vocab_offset":
        orig = vocab.VocabParallelEmbedding.__init__

        def init(self, weight, vocab_start, group, **kw):
            orig(self, weight, vocab_start + 1, group, **kw)
        vocab.VocabParallelEmbedding.__init__ = init
    elif mutant == "no_padding_mask":
        orig_fwd = cross_entropy._VocabParallelCrossEntropy.forward

        def fwd(ctx, logits, target, vocab_start, vocab_size, *rest):
            big = vocab_start + logits.shape[-1]  # pretend every column is real vocabulary
            return orig_fwd(ctx, logits, target, vocab_start, max(vocab_size, big), *rest)
        cross_entropy._VocabParallelCrossEntropy.forward = staticmethod(fwd)
    elif mutant == "g_backward_all_reduce":
        functions.AllReduceFwdIdentityBwd.backward = staticmethod(
            lambda ctx, grad: (functions._all_reduce(grad, ctx.group, {}), None, None)) \
            if False else staticmethod(lambda ctx, grad: (grad * 2, None, None))
    elif mutant:
        raise ValueError(f"unknown mutant {mutant!r}")


def _unplant() -> None:
    import importlib

    from labkit.parallel.tensor import cross_entropy, functions, layers, vocab

    for m in (functions, layers, vocab, cross_entropy):
        importlib.reload(m)


def tp_train(ctx, run: TPRun) -> dict:
    """Train ``run`` on ranks of one tp group; every rank returns its losses, its step-0
    gradients and final parameters gathered to full GPT names and shapes."""
    torch.set_num_threads(1)
    from labkit.parallel.pipeline.stage import StageModule

    if run.mutant:
        _plant(run.mutant)
    try:
        return _train(ctx, run, StageModule)
    finally:
        if run.mutant:
            _unplant()


def _train(ctx, run: TPRun, StageModule) -> dict:
    from labkit.parallel import tensor as tpmod

    group = ctx.group if run.tp > 1 else None
    model = build_model(run.model, seed=run.seed)
    if run.as_stage:
        model = StageModule(model, 0, 1)
    info = None
    if run.impl == "labkit":
        info = tpmod.apply_tensor_parallel(model, group, sequence_parallel=run.sp,
                                           regather=run.regather)
        loss_fn, ctx_mgr = model.loss, _null
    else:
        from torch.distributed.device_mesh import DeviceMesh

        from labkit.parallel.tensor.torch_tp import (torch_loss, torch_loss_context,
                                                     torch_tensor_parallel)
        mesh = DeviceMesh.from_group(ctx.group, "cpu")
        torch_tensor_parallel(model, mesh, sequence_parallel=run.sp)
        loss_fn, ctx_mgr = torch_loss, torch_loss_context
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay,
                            eps=run.eps)
    losses, grads = [], None
    for step in range(run.steps):
        x, y = batch(run, step)
        opt.zero_grad(set_to_none=True)
        with ctx_mgr():
            loss = loss_fn(model(x), y, "mean")
            loss.backward()
        loss = loss.detach()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        if step == 0:
            grads = _full(model, "grad", info)
        opt.step()
    return {"losses": losses, "grads": grads, "params": _full(model, "param", info),
            "info": None if info is None else {k: v for k, v in vars(info).items()
                                               if k != "shards"}}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _full(model, what: str, info) -> dict:
    if info is not None:
        from labkit.parallel.tensor import gather_full

        return gather_full(model, what)
    out = {}
    for n, p in model.named_parameters():
        t = p if what == "param" else p.grad
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[n] = t.detach().float().cpu().clone()
    return out
