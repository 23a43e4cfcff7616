"""One plain-SGD update through the data-parallel wrappers used directly, as a user's own job
would (tests/test_grad_scale.py). Importable by the ranks."""
from __future__ import annotations

import torch
from jobs_dp import MLP, _sharded, mlp_batch

from labkit.parallel.dp import DataParallel

LR = 0.5


def sgd_update(ctx, cfg: dict) -> dict:
    """:class:`jobs_dp.MLP` wrapped by ``cfg["wrapper"]`` (``naive``/``ddp``/``zero1..3``,
    default ``reduce_op``), this rank's batch ``mlp_batch(rank, 0)``, its mean loss,
    backward, the gradient sync, one ``torch.optim.SGD(lr=LR)`` step. Returns the full
    parameters after the update ``{name: fp32 tensor}``."""
    model, kind = MLP(), cfg["wrapper"]
    if kind in ("naive", "ddp"):
        wrapped = DataParallel(model, ctx.group, kind, bucket_mb=1e-3)
        params = list(model.parameters())
    else:
        wrapped = _sharded(model, dict(cfg, stage=int(kind[-1])), ctx.group)
        params = [u.master for u in wrapped.units]
    opt = torch.optim.SGD(params, lr=LR)
    x, y = mlp_batch(ctx.rank, 0)
    if cfg.get("mixed_precision"):  # bf16 units compute in bf16
        x, y = x.bfloat16(), y.bfloat16()
    wrapped(x, y).float().backward()
    wrapped.finish_gradient_sync()
    opt.step()
    if isinstance(wrapped, DataParallel):
        return {"state": {n: p.detach().float().clone() for n, p in model.named_parameters()}}
    wrapped.after_step()
    return {"state": wrapped.full_state_dict()}


def sgd_reference(ranks: int) -> dict:
    """One process: the same update on the mean of the ranks' mean losses; returns
    ``{"before", "after"}`` parameters by name."""
    model = MLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = sum(model(*mlp_batch(r, 0)) for r in range(ranks)) / ranks
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"before": before, "after": {n: p.detach().clone() for n, p in model.named_parameters()}}
