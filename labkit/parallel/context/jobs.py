"""Standalone context-parallel jobs, and the single-process references they must equal.

* :func:`attention_job` — one attention call (forward and backward) of
  :func:`.core.make_attention_core` on seeded ``q, k, v`` and output gradient: returns this
  rank's output, ``dQ``, ``dK``, ``dV`` shards, its work counter and saved bytes.
  :func:`reference_attention` is the same on one process with
  :func:`labkit.models.gpt.attention_core`.
* :func:`model_job` — the whole GPT with every block's ``attn.core`` set, token ids, labels
  and rotary positions sharded; the loss is the sum of this rank's token losses over the
  global token count and the gradients are summed over the ``cp`` group (the one-job rule),
  so :func:`reference_model` (one process, plain attention) must give the same loss (summed
  over ranks) and gradients (on every rank).

With ``mesh`` set (a :class:`labkit.mesh.Mesh` with ``cp`` and ``tp``), the ``cp`` group
comes from the mesh and each tensor-parallel rank takes its block of heads, as tensor
parallelism leaves them: the shapes the one training job hands the core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ... import comm
from ...config import ModelConfig
from ...mesh import Mesh
from ...models import build_model, text_batch
from ...models.gpt import attention_core
from .blocks import AttentionSpec, LocalAttention, WorkCounter
from .core import check_context_parallel, make_attention_core
from .layout import positions, shard_sequence
from .measure import SavedTensorMeter

__all__ = ["run", "AttentionCase", "attention_inputs", "reference_attention", "attention_job",
           "ModelCase", "model_job", "reference_model", "single_rank_core"]


@dataclass(frozen=True)
class AttentionCase:
    """One attention call: shapes (global, before tensor parallelism), method, layout.

    ``cp`` ranks run it (``None``: all the job's ranks), unless ``mesh`` is given (then
    ``mesh.cp``, with heads split over ``mesh.tp``; the job runs on ``mesh.size`` ranks).
    """

    method: str = "ring"
    causal: bool = True
    zigzag: bool = True
    batch: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    seq_len: int = 16
    head_dim: int = 8
    seed: int = 0
    cp: Optional[int] = None
    mesh: Optional[Mesh] = None

    @property
    def nranks(self) -> Optional[int]:
        """Ranks the job needs (``None``: the whole cluster)."""
        return self.mesh.size if self.mesh is not None else self.cp

    def model_config(self) -> ModelConfig:
        return ModelConfig(n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           d_model=self.n_heads * self.head_dim, seq_len=self.seq_len)

    def validate(self, world_size: int) -> None:
        """Raises ``ValueError`` (before launch) for a layout that cannot run."""
        cp, tp = (self.mesh.cp, self.mesh.tp) if self.mesh else (self.cp or world_size, 1)
        check_context_parallel(self.model_config(), cp, self.method, self.zigzag,
                               self.seq_len, tp=tp)


def run(cluster, case):
    """Run ``case`` (:class:`AttentionCase` or :class:`ModelCase`) on ``cluster``, on the
    ranks it needs; ``ValueError`` before launch for a layout that cannot run."""
    job = attention_job if isinstance(case, AttentionCase) else model_job
    return cluster.run(job, case, nranks=case.nranks)


def attention_inputs(case: AttentionCase) -> tuple:
    """Seeded fp32 ``q (B, A, S, D)``, ``k``, ``v`` ``(B, K, S, D)`` and ``dout (B, A, S, D)``."""
    g = torch.Generator().manual_seed(case.seed)
    b, a, kh, s, d = case.batch, case.n_heads, case.n_kv_heads, case.seq_len, case.head_dim
    return (torch.randn(b, a, s, d, generator=g), torch.randn(b, kh, s, d, generator=g),
            torch.randn(b, kh, s, d, generator=g), torch.randn(b, a, s, d, generator=g))


def reference_attention(case: AttentionCase) -> dict:
    """Single-process ``out``, ``dq``, ``dk``, ``dv`` (full tensors) from
    :func:`labkit.models.gpt.attention_core` (the explicit-softmax implementation)."""
    q, k, v, dout = attention_inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention_core(q, k, v, case.causal, impl="math")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def _cp_layout(ctx, mesh: Optional[Mesh]):
    """``(cp group, cp index, cp, tp index, tp)`` of this rank."""
    if mesh is None:
        return ctx.group, ctx.rank, ctx.world_size, 0, 1
    mg = ctx.mesh_groups(mesh)
    return mg.group("cp"), mg.index("cp"), mesh.cp, mg.index("tp"), mesh.tp


def attention_job(ctx, case: AttentionCase) -> dict:
    """One forward and backward of the context-parallel core on this rank's shard.

    Returns ``{"rank", "cp_rank", "tp_rank", "out", "dq", "dk", "dv"}`` (this rank's
    sequence shard of its heads), ``"work"`` (:meth:`.blocks.WorkCounter.to_dict`) and
    ``"saved_bytes"`` (what the core saved for backward beyond its inputs ``q, k, v``: the
    output and log-sum-exp, and all-gather's gathered K/V).
    """
    group, r, cp, t, tp = _cp_layout(ctx, case.mesh)
    q, k, v, dout = attention_inputs(case)
    ha, hk = case.n_heads // tp, case.n_kv_heads // tp
    q, dout = q[:, t * ha:(t + 1) * ha], dout[:, t * ha:(t + 1) * ha]
    k, v = k[:, t * hk:(t + 1) * hk], v[:, t * hk:(t + 1) * hk]
    q, k, v, dout = (shard_sequence(x, r, cp, case.zigzag, dim=2).to(ctx.device)
                     for x in (q, k, v, dout))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    core = make_attention_core(case.method, group, causal=case.causal, zigzag=case.zigzag,
                               seq_len=case.seq_len)
    ctx.tracer.step = 0
    with SavedTensorMeter((q, k, v)) as meter:
        out = core(q, k, v)
    out.backward(dout)
    ctx.tracer.step = -1
    cpu = lambda x: x.detach().cpu()  # noqa: E731
    return {"rank": ctx.rank, "cp_rank": r, "tp_rank": t, "out": cpu(out), "dq": cpu(q.grad),
            "dk": cpu(k.grad), "dv": cpu(v.grad), "work": core.counter.to_dict(),
            "saved_bytes": meter.bytes}


@dataclass(frozen=True)
class ModelCase:
    """The whole GPT under ``cp``-way context parallelism (``cp`` = the job's ranks)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, seq_len=16))
    method: str = "ring"
    zigzag: bool = True
    batch: int = 2
    seed: int = 0
    cp: Optional[int] = None

    @property
    def nranks(self) -> Optional[int]:
        return self.cp

    def validate(self, world_size: int) -> None:
        """Raises ``ValueError`` (before launch) for a layout that cannot run."""
        check_context_parallel(self.model, self.cp or world_size, self.method, self.zigzag,
                               self.model.seq_len)


def _loss(logits, targets, n_tokens: int):
    """Sum of token cross-entropies over the global token count (DESIGN §9)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum") / n_tokens


def model_job(ctx, case: ModelCase) -> dict:
    """One forward and backward of the GPT with context-parallel attention.

    Returns ``{"rank", "loss"}`` (the loss: this rank's share), ``"grads"`` (name → gradient summed over the
    cp group with :func:`labkit.comm.all_reduce`), ``"saved_bytes"`` (what the model's
    forward saved for backward, parameters excluded) and ``"work"``.
    """
    cfg, s, cp, r = case.model, case.model.seq_len, ctx.world_size, ctx.rank
    model = build_model(cfg, device=ctx.device, seed=case.seed)
    core = make_attention_core(case.method, ctx.group, causal=True, zigzag=case.zigzag,
                               seq_len=s)
    for block in model.layers:
        block.attn.core = core
    model.positions = positions(r, cp, s, case.zigzag, device=ctx.device)
    x, y = text_batch(0, case.batch, s, seed=case.seed)
    x, y = (shard_sequence(t, r, cp, case.zigzag).to(ctx.device) for t in (x, y))
    ctx.tracer.step = 0
    with SavedTensorMeter(model) as meter:  # the model's activations; the loss is outside
        logits = model(x)
    loss = _loss(logits, y, case.batch * s)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        comm.all_reduce(p.grad, "sum", ctx.group, axis="dp_cp")
        grads[name] = p.grad.detach().cpu()
    ctx.tracer.step = -1
    return {"rank": ctx.rank, "loss": loss.item(), "grads": grads, "saved_bytes": meter.bytes,
            "work": core.counter.to_dict()}


def single_rank_core(seq_len: int, causal: bool = True, counter: Optional[WorkCounter] = None):
    """The blockwise attention of :mod:`.blocks` on one rank (one chunk, no communication):
    the single-rank figure context parallelism divides."""
    counter = counter if counter is not None else WorkCounter()

    def core(q, k, v):
        spec = AttentionSpec((0,), (0,), seq_len, causal, counter, name="attention")
        return LocalAttention.apply(q, k, v, spec)

    return core


def reference_model(case: ModelCase, blockwise: bool = False) -> dict:
    """One process, whole sequence: ``{"loss", "grads", "saved_bytes"}``. ``blockwise``
    runs :func:`single_rank_core` instead of ``attention_core`` (same values; the
    saved-bytes figure of the same attention algorithm)."""
    cfg = case.model
    model = build_model(cfg, seed=case.seed)
    if blockwise:
        core = single_rank_core(cfg.seq_len)
        for block in model.layers:
            block.attn.core = core
    # contiguous like shard_sequence's copies: the embedding saves the ids' whole storage
    x, y = (t.contiguous() for t in text_batch(0, case.batch, cfg.seq_len, seed=case.seed))
    with SavedTensorMeter(model) as meter:
        logits = model(x)
    loss = _loss(logits, y, case.batch * cfg.seq_len)
    loss.backward()
    return {"loss": loss.item(), "saved_bytes": meter.bytes,
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}
