"""What a training run hands back by name at the full model's shapes: this rank's
parameters and first-step gradients with ZeRO, FSDP2, tensor- and expert-parallel shards
gathered (collective: every rank calls them), as fp32 CPU tensors comparable with the
single-process reference (:func:`labkit.train.reference`).
"""
from __future__ import annotations

import torch

from .. import comm
from ..parallel.dp import unique_parameters
from .rank_setup import RankSetup


def _named(setup: RankSetup, fn_param, fn_wrapper) -> dict:
    """``{full name: fp32 CPU tensor}`` over this rank's stages, at the full model's shapes:
    ``fn_wrapper(w)`` gathers a sharded stage over its ZeRO shard group (``{local name:
    tensor}``), ``fn_param(p)`` reads the rest; tensor-parallel shards are then gathered over
    the tp group (collective: every rank calls this)."""
    out = {}
    sharded = {id(w.module): w for w in setup.sharded}
    for s in sorted(setup.stages):
        m = setup.stages[s]
        local = {}
        if id(m) in sharded:
            local = {n: t.detach().float() for n, t in fn_wrapper(sharded[id(m)]).items()}
        for name, p in unique_parameters(m):
            if name not in local:
                v = fn_param(p)
                if v is not None:
                    local[name] = v
        info = getattr(m, "tp_info", None)
        experts = {n for n, q in unique_parameters(m) if any(q is e for e in setup.expert_params)}
        for name, t in local.items():
            if name in experts:  # each rank holds E/ep of the stacked experts
                t = _gather(setup, "ep", t, 0, None)
            if info is None:
                out[getattr(m, "full_name", lambda n: n)(name)] = t.cpu().clone()
            else:
                full, dim, size = info.shards[name]
                out[full] = _gather(setup, "tp", t, dim, size)
    if "tok_emb.weight" in out and setup.cfg.model_config.tie_embeddings:
        if any(getattr(m, "head", None) is not None for m in setup.stages.values()):
            out.setdefault("head.weight", out["tok_emb.weight"])  # one parameter, two names
    return out


def _gather(setup: RankSetup, axis: str, t: torch.Tensor, dim, size) -> torch.Tensor:
    """A shard rebuilt to its full shape: all-gathered over the ``axis`` group along ``dim``
    and cut to ``size`` (tensor parallelism's vocabulary padding dropped; ``None`` keeps
    all). ``dim=None`` or a degree-1 axis returns ``t`` as it is."""
    n = setup.mg.size(axis)
    if dim is None or n == 1:
        return t.float().cpu().clone()
    x = t.transpose(0, dim).contiguous() if dim else t.contiguous()
    buf = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(buf, x, group=setup.mg.group(axis), axis=axis)
    buf = buf.transpose(0, dim) if dim else buf
    return (buf if size is None else buf.narrow(dim, 0, size)).float().cpu().clone()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as a plain fp32 tensor on its device (FSDP2's DTensors
    gathered)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().float()


def _rank_state(setup: RankSetup) -> dict:
    return _named(setup, _full, lambda w: w.full_state_dict())


def _grab_grads(setup: RankSetup, out: dict, tracer):
    def grab(step: int) -> None:
        if step != 0:
            return
        # reading the gradients for the caller gathers shards: not the step's traffic
        enabled, tracer.enabled = tracer.enabled, False
        try:
            out["grads"] = _named(setup, lambda p: None if p.grad is None else _full(p.grad),
                                  lambda w: w.full_grads())
        finally:
            tracer.enabled = enabled
    return grab
