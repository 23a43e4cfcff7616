"""Jobs for the data-parallel wrapper tests (tests/test_dp_wrappers.py): rank-dependent
orders, every accumulation pattern, reduce ops, ignored parameters, mixed precision.
Importable by the ranks (tests/ is on their sys.path)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from labkit.parallel.dp import DataParallel, torch_ddp
from labkit.parallel.zero.fsdp import FullyShardedDataParallel, hsdp_groups
from labkit.parallel.zero import ZeroDataParallel

MIB2 = (512, 1024)  # 2 MiB of fp32


# ------------------------------------------------------------------ rank-dependent orders
class TwoParams(nn.Module):
    """The issue's model: ``Σ x_a·w_a + Σ x_b·w_b``, the terms in a rank-chosen order."""

    def __init__(self):
        super().__init__()
        self.w_a = nn.Parameter(torch.zeros(MIB2))
        self.w_b = nn.Parameter(torch.zeros(MIB2))

    def forward(self, x_a, x_b, a_first: bool):
        if a_first:
            ta = (x_a * self.w_a).sum()
            tb = (x_b * self.w_b).sum()
        else:
            tb = (x_b * self.w_b).sum()
            ta = (x_a * self.w_a).sum()
        return ta + tb


def _record_order(params: dict) -> list:
    order: list = []
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: order.append(n))
    return order


def _summary(t: torch.Tensor) -> tuple:
    return (t.min().item(), t.max().item())


def ddp_order(ctx, cfg: dict) -> dict:
    """Two steps of the two-parameter model: rank 0 computes the ``a`` term first, rank 1
    the ``b`` term. Returns per step the gradient order and (min, max) of each gradient."""
    model = TwoParams()
    order = _record_order({"a": model.w_a, "b": model.w_b})
    mode = cfg.get("mode", "ddp")
    if mode == "torch":
        wrapped = torch_ddp(model, ctx.group, bucket_mb=1)
    else:
        wrapped = DataParallel(model, ctx.group, mode, bucket_mb=1,
                               reduce_op=cfg.get("reduce_op", "avg"))
    r = ctx.rank
    out = []
    for _ in range(2):
        order.clear()
        x_a, x_b = torch.full(MIB2, r + 1.0), torch.full(MIB2, 10.0 * (r + 1))
        wrapped(x_a, x_b, a_first=r % 2 == 0).backward()
        if mode != "torch":
            wrapped.finish_gradient_sync()
        out.append({"order": list(order), "a": _summary(model.w_a.grad),
                    "b": _summary(model.w_b.grad)})
        model.w_a.grad = model.w_b.grad = None
    return {"steps": out}


class TwoUnits(nn.Module):
    """Root parameter ``scale`` (8) and two units ``layers[0]`` (A, weight 1) and
    ``layers[1]`` (B, weight 2), ``Linear(8, 8)`` each, on independent branches:
    returns the two terms of ``loss = Σ scale·A(x_a) + Σ scale·B(x_b)``, computing the
    branches in a rank-chosen order."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.layers = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)])
        with torch.no_grad():
            self.layers[0].weight.fill_(1.0)
            self.layers[1].weight.fill_(2.0)

    def forward(self, x_a, x_b, a_first: bool):
        A, B = self.layers
        if a_first:
            ya = A(x_a)
            yb = B(x_b)
        else:
            yb = B(x_b)
            ya = A(x_a)
        return (ya * self.scale).sum(), (yb * self.scale).sum()


def _sharded(model, cfg: dict, group, replicate_group=None):
    stage = cfg["stage"]
    kw = dict(reduce_op=cfg.get("reduce_op", "avg"),
              mixed_precision=cfg.get("mixed_precision", False),
              ignored_params=cfg.get("ignored", ()))
    if stage == 3:
        return FullyShardedDataParallel(model, group, replicate_group,
                                        prefetch=cfg.get("prefetch", True),
                                        keep_last=cfg.get("keep_last", True), **kw)
    return ZeroDataParallel(model, group, replicate_group, stage=stage, **kw)


def sharded_order(ctx, cfg: dict) -> dict:
    """Two steps of :class:`TwoUnits` under ZeRO ``cfg["stage"]``; rank 0 runs A first,
    rank 1 B first. With ``cfg["split"]`` each term gets its own backward, in the same
    rank-chosen order (a unit's gradient then completes in a rank-dependent order at every
    stage; in one backward, ZeRO-1/2's views are installed in unit order before forward, so
    their gradients complete in that order anyway, while ZeRO-3 follows the forward).
    Returns per step the loss, the order the units' gradients completed in, and the
    gathered gradients."""
    model = _sharded(TwoUnits(), cfg, ctx.group)
    order: list = []
    for u in model.units:
        u.flat.register_post_accumulate_grad_hook(lambda _f, n=u.name: order.append(n))
    r = ctx.rank
    out = []
    for _ in range(2):
        order.clear()
        x_a, x_b = torch.full((8,), r + 1.0), torch.full((8,), 10.0 * (r + 1))
        ta, tb = model(x_a, x_b, a_first=r % 2 == 0)
        if cfg.get("split"):
            for t in ((ta, tb) if r % 2 == 0 else (tb, ta)):
                t.backward()
        else:
            (ta + tb).backward()
        loss = ta + tb
        model.finish_gradient_sync()
        grads = {k: _summary(v) for k, v in model.full_grads().items()}
        out.append({"loss": loss.item(), "order": list(order), "grads": grads})
        model.zero_grad()
    return {"steps": out}


# ------------------------------------------------------------------ accumulation patterns
PATTERNS = {  # sync flag per microbatch ("direct": no hook fires, .grad written by hand;
    # "synced_then_partial": the last, unsynced, microbatch reaches only the root scale)
    "last": (False, False, True), "every": (True, True, True), "mixed": (True, False, True),
    "synced_then_not": (True, True, False), "none": (False, False, False),
    "direct": (False, False, False), "synced_then_partial": (True, True, False)}
PARTIAL = {"synced_then_partial": 2}  # pattern -> the microbatch that touches only the root


class MLP(nn.Module):
    """3-layer MLP (units ``layers``) and a root output scale."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)])
        self.out_scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x, y, partial: bool = False):
        if partial:
            return ((self.out_scale * y) ** 2).mean()
        for i, layer in enumerate(self.layers):
            if getattr(self, "recompute", False):  # the module call itself is recomputed,
                # to its end (no early stop: its forward hooks run again too)
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return ((x * self.out_scale - y) ** 2).mean()


def mlp_batch(rank: int, micro: int) -> tuple:
    """The ``(x (4, 6), y (4, 3))`` of ``rank``'s microbatch ``micro``."""
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def mlp_reference(ranks: int, micro: int = 3, reduce_op: str = "avg",
                  pattern: str = "last") -> dict:
    """Single process: the mean (or sum) over ranks of each rank's summed microbatch
    gradients, ``{name: tensor}``."""
    total: dict = {}
    for r in range(ranks):
        m = MLP()
        for k in range(micro):
            m(*mlp_batch(r, k), partial=PARTIAL.get(pattern) == k).backward()
        for n, p in m.named_parameters():
            total[n] = total.get(n, 0) + p.grad
    return {n: g / ranks if reduce_op == "avg" else g for n, g in total.items()}


def _wrap_mlp(ctx, cfg: dict):
    model, kind = MLP(), cfg["wrapper"]
    model.recompute = cfg.get("recompute", False)
    if kind in ("naive", "ddp"):
        return model, DataParallel(model, ctx.group, kind, bucket_mb=cfg.get("bucket_mb", 1e-3),
                                   reduce_op=cfg.get("reduce_op", "avg"))
    if kind == "torch":
        return model, torch_ddp(model, ctx.group, bucket_mb=1e-3)
    stage = int(kind[-1])
    shard, repl = ctx.group, None
    if kind.startswith("hsdp"):
        shard, repl = hsdp_groups(ctx.group, 2, ctx.cache)
    return model, _sharded(model, dict(cfg, stage=stage), shard, repl)


def _write_directly(model, wrapped, loss) -> None:
    """Gradients without autograd's accumulation (and so without its hooks), the way a
    weight-gradient pass writes ``.grad``."""
    if isinstance(wrapped, DataParallel):
        params = [p for p in model.parameters()]
    else:
        params = [u.flat for u in wrapped.units]
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        p.grad = g if p.grad is None else p.grad.add_(g)


def accumulate(ctx, cfg: dict) -> dict:
    """One step of three microbatches of :class:`MLP` with the sync pattern
    ``cfg["pattern"]``; returns the synced gradients ``{name: tensor}``."""
    model, wrapped = _wrap_mlp(ctx, cfg)
    flags = PATTERNS[cfg["pattern"]]
    for k, sync in enumerate(flags):
        x, y = mlp_batch(ctx.rank, k)
        with (_null() if sync else wrapped.no_sync()):
            loss = wrapped(x, y, partial=PARTIAL.get(cfg["pattern"]) == k)
            if cfg["pattern"] == "direct":
                _write_directly(model, wrapped, loss)
            else:
                loss.backward()
    if cfg["wrapper"] == "torch":
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    wrapped.finish_gradient_sync()
    if isinstance(wrapped, DataParallel):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    else:
        grads = wrapped.full_grads()
    try:
        wrapped.finish_gradient_sync()
        repeated = None
    except RuntimeError as e:
        repeated = str(e)
    return {"grads": grads, "repeated": repeated}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------ two wrappers, two groups
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense, self.expert = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.dense(x)) + self.expert(x)


class DenseAndExperts(nn.Module):
    """``layers[0]`` holds a dense ``Linear(4, 4)`` and an "expert" ``Linear(4, 4)``;
    ``head`` is dense. Expert weights start rank-dependent (rank + 1)."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Block()])
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.layers[0].expert.weight.fill_(rank + 1.0)
            self.layers[0].expert.bias.fill_(0.0)

    def experts(self) -> list:
        return list(self.layers[0].expert.parameters())

    def forward(self, x):
        return self.head(self.layers[0](x)).pow(2).mean()


def dense_experts_batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))


def two_wrappers(ctx, cfg: dict) -> dict:
    """Dense parameters under ``cfg["dense"]`` (``ddp``/``zero2``/``zero3``) over the world
    (4 ranks), expert parameters under a DataParallel over the replicate pairs {0, 2},
    {1, 3}. Returns expert weights after construction, expert gradients before and after
    the second wrapper's sync, and the dense gradients."""
    from labkit.mesh import Mesh

    groups = ctx.mesh_groups(Mesh(dp_replicate=2, dp_shard=2))
    model = DenseAndExperts(ctx.rank)
    experts = model.experts()
    kind = cfg["dense"]
    if kind == "ddp":
        dense = DataParallel(model, ctx.group, "ddp", bucket_mb=1e-4, ignored_params=experts)
    else:
        dense = _sharded(model, dict(stage=int(kind[-1]), ignored=experts), ctx.group)
    hooks_on_experts = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                           for p in experts)
    expert_dp = DataParallel(model, groups.group("dp_replicate"), "ddp", bucket_mb=1e-4,
                             ignored_params=[p for p in model.parameters()
                                             if all(p is not q for q in experts)])
    after_wrap = experts[0].detach().clone()
    dense(dense_experts_batch(ctx.rank)).backward()
    dense.finish_gradient_sync()
    local = [p.grad.clone() for p in experts]
    expert_dp.finish_gradient_sync()
    if isinstance(dense, DataParallel):
        dense_grads = {n: p.grad.clone() for n, p in model.named_parameters()
                       if all(p is not q for q in experts)}
    else:
        dense_grads = dense.full_grads()
    return {"hooks_on_experts_before_second": hooks_on_experts,
            "expert_weight_after_wrap": after_wrap, "expert_local": local,
            "expert_synced": [p.grad.clone() for p in experts], "dense": dense_grads}


def dense_experts_reference(world: int = 4) -> dict:
    """Per rank, single process: ``{rank: {name: grad}}`` of :class:`DenseAndExperts` with
    the expert weights each wrapper leaves (experts broadcast within the pairs, so rank r
    holds rank (r mod 2)'s initial expert)."""
    out = {}
    for r in range(world):
        m = DenseAndExperts(r % 2)
        m(dense_experts_batch(r)).backward()
        out[r] = {n: p.grad.clone() for n, p in m.named_parameters()}
    return out


# ------------------------------------------------------------------ mixed precision (bf16)
def bf16_mean(ctx, cfg: dict) -> dict:
    """bf16 ZeRO-``stage``: ``Linear(3, 1)`` with bf16-exact weights, one row per rank,
    mean squared output; returns the gathered gradient (exact in bf16)."""
    lin = nn.Linear(3, 1)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[0.5, -0.25, 1.0]]))
        lin.bias.fill_(0.125)
    model = _sharded(lin, dict(stage=cfg["stage"], mixed_precision=True,
                               reduce_op=cfg.get("reduce_op", "avg")), ctx.group)
    rows = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 5.0, 0.5]], dtype=torch.bfloat16)
    model(rows[ctx.rank:ctx.rank + 1]).pow(2).mean().backward()
    model.finish_gradient_sync()
    return model.full_grads()


def _gpt_run():
    from labkit.config import RunConfig
    return RunConfig(steps=2, global_batch=4, measure_memory=False, count_flops=False)


def gpt_sharded(ctx, cfg: dict) -> dict:
    """Two AdamW steps of the tiny GPT on this rank's batches under labkit's ZeRO-``stage``
    (``impl="labkit"``) or FSDP2 ``fully_shard`` (``impl="fsdp2"``), ``bf16`` or fp32.
    Returns per step the loss and the gathered gradients, and the final parameters."""
    from labkit.models import build_model
    from labkit.train import rank_batch as local_batch

    run = _gpt_run().replace(dp=ctx.world_size)
    model = build_model(run.model_config, device=ctx.device, seed=run.seed)
    bf16 = cfg.get("bf16", True)
    if cfg["impl"] == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        key = ("jobs_dp-mesh", ctx.world_size)
        if key not in ctx.cache:
            ctx.cache[key] = DeviceMesh.from_group(ctx.group, "cpu", mesh_dim_names=("shard",))
        kw = {"mesh": ctx.cache[key]}
        if bf16:
            # cast_forward_inputs=False: the blocks take the fp32 rotary tables as an
            # input, which FSDP2 would otherwise round to bf16 (labkit keeps buffers fp32)
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.bfloat16,
                                                   cast_forward_inputs=False)
        for block in model.layers:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        wrapped = model
        opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
    else:
        wrapped = _sharded(model, dict(stage=cfg["stage"], mixed_precision=bf16), ctx.group)
        opt = wrapped.optimizer(run.lr, run.weight_decay)
    steps = []
    for s in range(run.steps):
        ctx.tracer.step = s
        x, y = local_batch(run, s, ctx.rank, ctx.device)
        loss = wrapped(x, y)
        loss.backward()
        if cfg["impl"] == "fsdp2":
            grads = {n: p.grad.detach().full_tensor().float()
                     for n, p in model.named_parameters()}
        else:
            wrapped.finish_gradient_sync()
            grads = wrapped.full_grads()
        steps.append({"loss": loss.item(), "grads": grads})
        opt.step()
        if cfg["impl"] == "fsdp2":
            opt.zero_grad(set_to_none=True)
        else:
            wrapped.after_step()
            wrapped.zero_grad()
    if cfg["impl"] == "fsdp2":
        params = {n: p.detach().full_tensor().float() for n, p in model.named_parameters()}
    else:
        params = dict(zip(wrapped.names, _split(wrapped)))
    return {"steps": steps, "params": params}


def _split(wrapped) -> list:
    """The fp32 master parameters, gathered, in ``wrapped.names`` order."""
    grads = wrapped._gather_named(lambda u: u.master.detach(), as_dict=True)
    return [grads[n] for n in wrapped.names]


def gpt_bf16_reference(ctx, world: int) -> list:
    """Job (one rank: the ranks' numerics, thread count included): the single-process,
    bf16-aware reference. Per rank of a ``world``-rank run, the loss and gradients of the
    first step's batch under the same bf16 weights the sharded runs start from (the fp32
    weights rounded; buffers such as the rotary tables stay fp32, as in the wrappers):
    ``[{"loss", "grads": {name: fp32 grad}}]``."""
    from labkit.models import build_model
    from labkit.train import rank_batch as local_batch

    run = _gpt_run().replace(dp=world)
    model = build_model(run.model_config, seed=run.seed)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    out = []
    for r in range(world):
        model.zero_grad(set_to_none=True)
        loss = model(*local_batch(run, 0, r, "cpu"))
        loss.backward()
        out.append({"loss": loss.item(),
                    "grads": {n: p.grad.float().clone() for n, p in model.named_parameters()}})
    return out


def collective_sequence(trace, rank: int, ops=("all_reduce", "reduce_scatter", "all_gather")):
    """``[(op, tag, numel)]`` of ``rank``'s collectives in the order it issued them."""
    evs = sorted((e for e in trace.events if e.rank == rank and e.op in ops),
                 key=lambda e: e.start)
    return [(e.op, e.args.get("bucket", e.args.get("unit")), e.args.get("numel")) for e in evs]


def world_is(ctx, n: int) -> None:
    assert dist.get_world_size(ctx.group) == n


# ------------------------------------------------------------------ recomputation inside FSDP
def gpt_checkpointed(ctx, cfg: dict) -> dict:
    """One step of the tiny GPT under labkit's ZeRO-``stage`` with the blocks checkpointed by
    ``cfg["policy"]`` (recomputed in backward); returns the loss and gathered gradients."""
    from labkit.models import build_model
    from labkit.parallel.checkpoint.policy import apply_checkpoint_policy
    from labkit.train import rank_batch as local_batch

    run = _gpt_run().replace(dp=ctx.world_size)
    model = build_model(run.model_config, device=ctx.device, seed=run.seed)
    if cfg["policy"] != "none":
        apply_checkpoint_policy(model, cfg["policy"], cfg.get("every", 1))
    wrapped = _sharded(model, dict(stage=cfg["stage"]), ctx.group)
    loss = wrapped(*local_batch(run, 0, ctx.rank, ctx.device))
    loss.backward()
    wrapped.finish_gradient_sync()
    return {"loss": loss.item(), "grads": wrapped.full_grads()}


# ------------------------------------------------------------------ unused parameters
def unused_pattern(ctx, cfg: dict) -> dict:
    """Two microbatches of ``jobs_for_tests.TwoHeads`` (``head_b`` never used) under
    DataParallel ``cfg["mode"]``, synced per ``cfg["pattern"]``; returns the gradients."""
    from jobs_for_tests import TwoHeads

    torch.manual_seed(0)
    model = DataParallel(TwoHeads(), ctx.group, mode=cfg["mode"], bucket_mb=1.0,
                         find_unused=cfg["find_unused"])
    for k, sync in enumerate(PATTERNS[cfg["pattern"]][1:]):
        with (_null() if sync else model.no_sync()):
            model(torch.full((2, 4), float(ctx.rank + 1 + k))).backward()
    model.finish_gradient_sync()
    return _plain_grads(model.module)


# ------------------------------------------------------------------ unused vs torch DDP
class SomeUnused(nn.Module):
    """``used`` every rank, ``rank0`` only on rank 0's forward, ``never`` on no rank."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.rank0 = nn.Linear(4, 3)
        self.never = nn.Linear(4, 3)

    def forward(self, x, use_rank0: bool):
        y = self.used(x)
        if use_rank0:
            y = y + self.rank0(x)
        return y.pow(2).mean()


UNUSED_LR, UNUSED_WD = 0.1, 0.5


def _unused_input(rank: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) / 4 - rank


def _unused_outcome(model, grads: dict) -> dict:
    return {"grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _plain_grads(model) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()}


def unused_vs_torch(ctx, cfg: dict) -> dict:
    """One AdamW step (lr 0.1, weight decay 0.5) of :class:`SomeUnused` on every rank, as a
    user's job: labkit ``DataParallel(mode, find_unused=True)`` (``"ddp"``, ``"naive"``),
    torch's own ``DistributedDataParallel(find_unused_parameters=True)``, ZeRO ``stage`` 1–3,
    and one process over all the ranks' inputs (computed on each rank alone, no
    collectives). Returns per implementation the gradients before the step (``None`` kept)
    and the parameters after it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, r = ctx.world_size, ctx.rank
    out = {}

    def fresh():
        torch.manual_seed(0)
        return SomeUnused()

    for kind in ("ddp", "naive", "torch", "zero1", "zero2", "zero3"):
        model = fresh()
        if kind == "torch":
            w = DDP(model, process_group=ctx.group, find_unused_parameters=True)
        elif kind.startswith("zero"):
            w = _sharded(model, dict(stage=int(kind[-1])), ctx.group)
        else:
            w = DataParallel(model, ctx.group, kind, find_unused=True)
        w(_unused_input(r), use_rank0=r == 0).backward()
        if kind.startswith("zero"):
            w.finish_gradient_sync()
            grads = w.full_grads()
            opt = w.optimizer(lr=UNUSED_LR, weight_decay=UNUSED_WD)
            opt.step()
            w.after_step()
            out[kind] = {"grads": grads, "params": w.full_state_dict()}
            continue
        if kind != "torch":
            w.finish_gradient_sync()
        grads = _plain_grads(model)
        torch.optim.AdamW(model.parameters(), lr=UNUSED_LR, weight_decay=UNUSED_WD).step()
        out[kind] = _unused_outcome(model, grads)
    model = fresh()  # one process: the mean of the ranks' losses
    sum(model(_unused_input(q), use_rank0=q == 0) for q in range(n)).div(n).backward()
    grads = _plain_grads(model)
    torch.optim.AdamW(model.parameters(), lr=UNUSED_LR, weight_decay=UNUSED_WD).step()
    out["one"] = _unused_outcome(model, grads)
    return out
