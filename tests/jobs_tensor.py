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
    attention: str = "sdpa"       # or "math"
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
    model = build_model(run.model, seed=run.seed, attention=run.attention)
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




def _plant(mutant: str):
    """Swap in a wrong piece of labkit's tensor parallelism in this rank process; returns the
    function that puts the right one back."""
    from labkit.parallel.tensor import attention, cross_entropy, functions, layers, vocab

    undo = []

    def patch(obj, name, value):
        undo.append((obj, name, obj.__dict__[name]))
        setattr(obj, name, value)

    if mutant == "no_sp_norm_grad_sum":      # norm weight used without the tp-sum of its grad
        patch(layers, "copy_to_tp", lambda x, group, **tags: x)
    elif mutant == "no_kv_grad_sum":         # replicated K/V weight without the tp-sum
        patch(attention, "copy_to_tp", lambda x, group, **tags: x)
    elif mutant == "wrong_vocab_offset":     # embedding rows shifted by one id
        orig = vocab.VocabParallelEmbedding.__init__

        def init(self, weight, vocab_start, group, **kw):
            orig(self, weight, vocab_start + 1, group, **kw)
        patch(vocab.VocabParallelEmbedding, "__init__", init)
    elif mutant == "no_padding_mask":        # padding columns counted as vocabulary
        fn = cross_entropy._VocabParallelCrossEntropy.forward

        def fwd(ctx, logits, target, vocab_start, vocab_size, *rest):
            return fn(ctx, logits, target, vocab_start, 10**9, *rest)
        patch(cross_entropy._VocabParallelCrossEntropy, "forward", staticmethod(fwd))
    elif mutant == "g_backward_all_reduce":  # g's backward sums again (a common slip)
        g = functions.AllReduceFwdIdentityBwd

        def forward(ctx, x, group, tags):
            ctx.group = group
            return functions._all_reduce(x, group, tags)
        patch(g, "forward", staticmethod(forward))
        patch(g, "backward", staticmethod(
            lambda ctx, grad: (functions._all_reduce(grad, ctx.group, {}), None, None)))
    elif mutant == "wrong_kv_head":          # a replicated K/V head read by the wrong ranks
        orig = attention.ReplicatedKV.__init__

        def init(self, weight, head, head_dim, group, tags):
            n_heads = weight.shape[0] // head_dim
            orig(self, weight, functions.tp_rank(group) % n_heads, head_dim, group, tags)
        patch(attention.ReplicatedKV, "__init__", init)
    elif mutant == "sp_gather_order":        # sequence pieces concatenated batch-major
        def gather(x, group, tags=None):
            n = functions.tp_size(group)
            x = x.contiguous()
            buf = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]))
            functions.comm.all_gather(buf, x, group=group, axis="tp")
            return buf.reshape(x.shape[0], n * x.shape[1], *x.shape[2:])
        patch(functions, "gather_seq", gather)
    elif mutant == "ce_local_max":           # each rank shifts by its own max
        patch(cross_entropy.comm, "all_reduce", _skip_max(cross_entropy.comm.all_reduce))
    elif mutant:
        raise ValueError(f"unknown mutant {mutant!r}")

    def restore():
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)
    return restore


def _skip_max(all_reduce):
    def call(tensor, op="sum", **kw):
        if op != "max":
            all_reduce(tensor, op, **kw)
    return call


def tp_train(ctx, run: TPRun) -> dict:
    """Train ``run`` on ranks of one tp group; every rank returns its losses, its step-0
    gradients and final parameters gathered to full GPT names and shapes."""
    torch.set_num_threads(1)
    from labkit.parallel.pipeline.stage import StageModule

    restore = _plant(run.mutant)
    try:
        return _train(ctx, run, StageModule)
    finally:
        restore()


def _train(ctx, run: TPRun, StageModule) -> dict:
    from labkit.parallel import tensor as tpmod

    group = ctx.group
    model = build_model(run.model, seed=run.seed, attention=run.attention)
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


def tp_measure(ctx, run: TPRun) -> dict:
    """Activation bytes per block (plain and with the attention core recomputed), then one
    traced training step (step 0) and the model-state bytes after it."""
    torch.set_num_threads(1)
    from labkit.parallel.tensor import apply_tensor_parallel
    from labkit.parallel.tensor.activations import (measure_block_activations,
                                                    recompute_attention_core)
    from labkit.parallel.tensor.measure import measured_state_bytes

    model = build_model(run.model, seed=run.seed, attention=run.attention)
    info = apply_tensor_parallel(model, ctx.group, sequence_parallel=run.sp,
                                 regather=run.regather)
    x, y = batch(run, 0)
    act = measure_block_activations(model, x)
    with recompute_attention_core(model):
        act_rc = measure_block_activations(model, x)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, eps=run.eps)
    ctx.tracer.step = 0
    loss = model.loss(model(x), y, "mean")
    loss.backward()
    opt.step()
    ctx.tracer.step = -1
    return {"act": act, "act_recompute": act_rc, "state": measured_state_bytes(model, opt),
            "padding_bytes": info.padding_bytes, "padding_bytes_total": info.padding_bytes_total}


@dataclass(frozen=True)
class CECase:
    """A cross-entropy check: ``n`` tokens over a vocabulary of ``vocab``."""

    vocab: int = 37
    n: int = 24
    scale: float = 1.0            # logits ~ N(0, scale²); 1e4 checks stability
    label_smoothing: float = 0.0
    ignore: bool = False          # a quarter of the targets are ignore_index
    reduction: str = "mean"
    garbage: float = 1e4          # what the padding columns hold (they must not count)
    mutant: str = ""


def ce_inputs(case: CECase) -> tuple:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(case.n, case.vocab, generator=g) * case.scale
    targets = torch.randint(0, case.vocab, (case.n,), generator=g)
    if case.ignore:
        targets[::4] = -100
    weights = torch.rand(case.n, generator=g) + 0.5   # d(loss)/d(out) for reduction="none"
    return logits, targets, weights


def ce_check(ctx, case: CECase) -> dict:
    """This rank's vocab-parallel loss and the gradient of its logit shard (padding columns
    filled with ``case.garbage``)."""
    from labkit.parallel.tensor import vocab_parallel_cross_entropy
    from labkit.parallel.tensor.vocab import padded_vocab

    restore = _plant(case.mutant)
    try:
        logits, targets, weights = ce_inputs(case)
        n = ctx.world_size
        vp = padded_vocab(case.vocab, n)
        full = torch.full((case.n, vp), case.garbage)
        full[:, :case.vocab] = logits
        per = vp // n
        local = full[:, ctx.rank * per:(ctx.rank + 1) * per].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, ctx.group,
                                            vocab_start=ctx.rank * per, vocab_size=case.vocab,
                                            label_smoothing=case.label_smoothing,
                                            reduction=case.reduction)
        (loss * weights if case.reduction == "none" else loss).sum().backward()
        return {"loss": loss.detach(), "grad": local.grad, "start": ctx.rank * per}
    finally:
        restore()


def tp_hooks(ctx, run: TPRun) -> dict:
    """What ``attn.core`` receives after the convert (and that the output is unchanged), and
    how a tied GPT's first and last pipeline stages shard the vocabulary."""
    torch.set_num_threads(1)
    from labkit.models.gpt import attention_core
    from labkit.parallel.pipeline.stage import StageModule
    from labkit.parallel.tensor import apply_tensor_parallel

    model = build_model(run.model, seed=run.seed)
    apply_tensor_parallel(model, ctx.group, sequence_parallel=run.sp)
    x, _ = batch(run, 0)
    plain = model(x).detach()
    shapes = []

    def core(q, k, v):
        shapes.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return attention_core(q, k, v, True, "sdpa")
    for block in model.layers:
        block.attn.core = core
    hooked = model(x).detach()
    gpt = build_model(run.model, seed=run.seed)
    first, last = StageModule(gpt, 0, 2), StageModule(gpt, 1, 2)
    i0 = apply_tensor_parallel(first, ctx.group, sequence_parallel=run.sp)
    i1 = apply_tensor_parallel(last, ctx.group, sequence_parallel=run.sp)
    return {"shapes": shapes, "same": torch.equal(plain, hooked),
            "emb": first.tok_emb.weight.detach(), "head": last.head.weight.detach(),
            "starts": (i0.vocab_start, i1.vocab_start), "tied": (i0.tied, i1.tied),
            "positions": (i0.positions_set, i1.positions_set),
            "boundary": i0.boundary_shape(run.batch, run.model.seq_len, run.model.d_model)}


# ------------------------------------------------------------------ biased linears
def biased_pair(ctx, cfg: dict) -> dict:
    """``Linear(8→16, bias) → tanh → Linear(16→8, bias)`` split column → row over tp groups
    of ``cfg["tp"]`` consecutive ranks (several groups: the tp group is not the whole world),
    with ``cfg["sp"]`` sequence parallelism; each tp group gets its own input. Returns this
    rank's output, input gradient and parameter gradients beside one process's ``nn.Linear``
    pair on the same input, sliced as this rank holds them."""
    import torch.distributed as dist
    from torch import nn

    from labkit.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    t, sp, r = cfg["tp"], cfg["sp"], ctx.rank
    groups = [dist.new_group(list(range(g, g + t))) for g in range(0, ctx.world_size, t)]
    group, k, d = groups[r // t], r % t, r // t
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    gen = torch.Generator().manual_seed(100 + d)
    x = torch.randn(2, 4, 8, generator=gen)
    w_out = torch.randn(2, 4, 8, generator=gen)
    # one process
    xr = x.clone().requires_grad_()
    yr = lin2(torch.tanh(lin1(xr)))
    (yr * w_out).sum().backward()
    # this rank's shard
    col = ColumnParallelLinear.from_linear(lin1, group, k, sequence_parallel=sp)
    row = RowParallelLinear.from_linear(lin2, group, k, sequence_parallel=sp)
    s = x.shape[1] // t
    cut = (lambda z: z[:, k * s:(k + 1) * s]) if sp else (lambda z: z)
    xl = cut(x).clone().requires_grad_()
    y = row(torch.tanh(col(xl)))
    (y * cut(w_out)).sum().backward()
    f = 16 // t
    # the fused gate/up matmuls of ParallelSwiGLU add their column biases too
    from types import SimpleNamespace

    from labkit.parallel.tensor.attention import ParallelSwiGLU

    mlp = SimpleNamespace(w1=nn.Linear(8, 16), w3=nn.Linear(8, 16), w2=nn.Linear(16, 8))
    xr2 = x.clone().requires_grad_()
    ((mlp.w2(F.silu(mlp.w1(xr2)) * mlp.w3(xr2))) * w_out).sum().backward()
    par = ParallelSwiGLU(mlp, group, k, sequence_parallel=sp)
    xl2 = cut(x).clone().requires_grad_()
    y2 = par(xl2)
    (y2 * cut(w_out)).sum().backward()
    return {"swiglu.y": (y2.detach(), cut(mlp.w2(F.silu(mlp.w1(x)) * mlp.w3(x)).detach())),
            "swiglu.dx": (xl2.grad, cut(xr2.grad)),
            "swiglu.w1.bias": (par.w1.bias.grad, mlp.w1.bias.grad[k * f:(k + 1) * f]),
            "swiglu.w3.bias": (par.w3.bias.grad, mlp.w3.bias.grad[k * f:(k + 1) * f]),
            "swiglu.w2.bias": (par.w2.bias.grad, mlp.w2.bias.grad),
            "y": (y.detach(), cut(yr.detach())), "dx": (xl.grad, cut(xr.grad)),
            "col.weight": (col.weight.grad, lin1.weight.grad[k * f:(k + 1) * f]),
            "col.bias": (col.bias.grad, lin1.bias.grad[k * f:(k + 1) * f]),
            "row.weight": (row.weight.grad, lin2.weight.grad[:, k * f:(k + 1) * f]),
            "row.bias": (row.bias.grad, lin2.bias.grad)}
