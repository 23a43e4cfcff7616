"""The ViT under tensor, sequence and context parallelism, from the GPT's own layers.

A ViT block is the GPT's block with the causal mask off, so the GPT's pieces apply as they
are (DESIGN.md §9 order: tensor → context → checkpoint → data parallelism):

* **Tensor parallelism** (Shoeybi et al. 2019 §3): each block's attention and SwiGLU become
  :class:`~labkit.parallel.tensor.ParallelAttention` / ``ParallelSwiGLU`` (column then row
  split, one all-reduce forward and one backward each). The patch projection, class token,
  position table, final norm and the 10-way head are tiny and stay whole on every tp rank;
  every tp rank computes the same loss.
* **Sequence parallelism** (Korthikanti et al. 2022 §4.2.2): the embedded sequence is cut to
  this rank's ``S/(cp·T)`` tokens (forward split, backward all-gather), the norms run on
  those tokens (weights summed over tp), and the pooled token sum is all-reduced over tp.
* **Context parallelism** (Liu et al. 2023, ring attention; Jacobs et al. 2023; Dubey et al.
  2024 §3.3.2): each cp rank keeps ``S/cp`` of the tokens after the position table is
  added, and every block's attention runs the context-parallel core **without the causal
  mask**. Zigzag ordering is unnecessary here: it exists to balance the causal triangle, but
  in bidirectional attention every query meets all ``S`` keys, so contiguous chunks already
  give every rank ``S/cp · S`` query-key pairs (the split is still honoured if asked for; it
  only permutes tokens, which mean pooling does not see).

The classifier needs the whole image, so the mean-pooled token sum is completed over cp by
an all-reduce whose backward is an all-reduce too (:class:`SumOverContext`), and each cp rank
takes ``1/cp`` of the per-image loss: the job's one loss rule (every gradient a plain sum
over the data and context ranks) then yields exactly the single-process gradient.
Context parallelism needs ``pool="mean"`` (no class token), so the ``P`` patch tokens split
evenly.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from .tensor.functions import gather_seq, reduce_from_tp, tp_rank, tp_size

__all__ = ["check_vit_parallel", "apply_vit_parallel", "SumOverContext", "SplitSequence"]


def check_vit_parallel(mc, tp: int, cp: int, sequence_parallel: bool, zigzag: bool,
                       pp: int = 1, ep: int = 1, cp_method: str = "ring") -> None:
    """Refuse, before launch, a ViT layout the job cannot run.

    Checks: no pipeline or expert parallelism (not built for the ViT); heads, K/V heads and
    the SwiGLU width divisible by ``tp``; with ``cp > 1`` or sequence parallelism,
    ``pool="mean"`` and the ``P`` patch tokens divisible by ``cp`` (``2·cp`` zigzag) and, with
    sequence parallelism, by ``cp·tp``; the context-parallel method's own limits
    (:func:`~labkit.parallel.context.check_context_parallel`, e.g. Ulysses' heads).

    Raises:
        ValueError: naming the field and the numbers.
    """
    if (pp, ep) != (1, 1):
        raise ValueError(f"the ViT trains with data, tensor (and sequence) and context "
                         f"parallelism; pipeline and expert parallelism are not built for it: "
                         f"got pp={pp}, ep={ep}")
    if mc.n_heads % tp or mc.kv_heads % tp or mc.ffn_dim % tp:
        raise ValueError(f"ViT tensor parallelism: n_heads={mc.n_heads}, kv heads="
                         f"{mc.kv_heads} and ffn_dim={mc.ffn_dim} must divide by tp={tp}")
    if cp == 1 and not (sequence_parallel and tp > 1):
        return
    p = (mc.image_size // mc.patch_size) ** 2
    if mc.pool != "mean":
        raise ValueError(f"ViT with cp={cp}, sequence_parallel={sequence_parallel}: the "
                         f"sequence must split evenly, but pool={mc.pool!r} adds a class token "
                         f"to the {p} patches ({p + 1} tokens); use ModelConfig.pool='mean'")
    div = (2 * cp if zigzag and cp > 1 else cp) * (tp if sequence_parallel else 1)
    if p % div:
        raise ValueError(f"ViT: the {p} patch tokens ((image_size {mc.image_size} / patch_size "
                         f"{mc.patch_size})²) do not divide by {div} (cp={cp}"
                         f"{' ×2 for zigzag' if zigzag and cp > 1 else ''}"
                         f"{f', × tp={tp} for SP' if sequence_parallel else ''})")
    if cp > 1:
        import dataclasses

        from .context.core import check_context_parallel

        # the ViT has no rotary table: its sequence is the patches
        check_context_parallel(dataclasses.replace(mc, seq_len=p), cp, cp_method, zigzag, p,
                               tp=tp)


class SumOverContext(torch.autograd.Function):
    """All-reduce (sum) over the cp group forward **and** backward.

    Each cp rank's output feeds its own share of the objective (``1/cp`` of the loss), and
    the objective is their sum, so the gradient of a rank's partial input is the sum of every
    rank's output gradient: the adjoint of an all-reduce is an all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, group=group, axis="cp", site="vit_pool", phase="forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, group=ctx.group, axis="cp", site="vit_pool", phase="backward")
        return out, None


class SplitSequence(torch.autograd.Function):
    """Sequence parallelism's entry (Korthikanti et al. 2022 §4.2.2, Megatron-LM's
    ``scatter_to_sequence_parallel_region``): forward keeps this tp rank's ``S/T`` tokens of
    ``(B, S, H)`` (held whole on every rank), backward all-gathers the token gradients so the
    whole-held embeddings receive the full gradient on every tp rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n, r = tp_size(group), tp_rank(group)
        s = x.shape[1] // n
        return x[:, r * s:(r + 1) * s].contiguous()

    @staticmethod
    def backward(ctx, grad):
        tags = {"site": "vit_split", "phase": "backward"}
        return gather_seq(grad.contiguous(), ctx.group, tags), None


def _cp_loss(cp: int):
    def loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
        # every cp rank classifies the same images: each takes 1/cp of the loss
        return F.cross_entropy(logits.float(), targets, reduction=reduction) / cp
    return loss


def apply_vit_parallel(model: nn.Module, *, tp_group=None, cp_group=None,
                       sequence_parallel: bool = False, cp_method: str = "ring",
                       zigzag: bool = False):
    """Make a full-weight :class:`~labkit.models.vit.ViT` this rank's tp/cp shard, in place.

    ``model(images)`` then returns the full logits ``(B, n_classes)`` on every rank (images
    ``(B, C, H, W)`` whole on every tp and cp rank), and with ``cp > 1``
    ``model.loss(logits, y, "sum")`` is ``1/cp`` of the cross-entropy sum (nats). Returns
    ``(tp_info or None, cp_core or None)``; ``tp_info.shards`` maps every parameter to its
    full name and split dim, for gathering (:func:`labkit.train._named`).

    Raises:
        ValueError: a layout :func:`check_vit_parallel` refuses.
    """
    from .tensor import ParallelAttention, ParallelRMSNorm, ParallelSwiGLU
    from .tensor.convert import TensorParallelInfo, _shard_specs

    mc = model.cfg
    tp = tp_size(tp_group)
    cp = 1 if cp_group is None else comm.group_size(cp_group)
    sp = sequence_parallel and tp > 1
    check_vit_parallel(mc, tp, cp, sp, zigzag, cp_method=cp_method)
    info = core = None
    cuts = []
    if cp > 1:
        import torch.distributed as dist

        from .context import make_attention_core, shard_sequence

        rank = dist.get_rank(cp_group)
        core = make_attention_core(cp_method, cp_group, causal=False, zigzag=zigzag,
                                   seq_len=model.n_tokens)
        for block in model.layers:
            block.attn.core = core
        cuts.append(lambda x: shard_sequence(x, rank, cp, zigzag, dim=1))
        model.loss = _cp_loss(cp)
    if tp > 1:
        r = tp_rank(tp_group)
        kw = dict(sequence_parallel=sp)
        for i, block in enumerate(model.layers):
            block.attn_norm = ParallelRMSNorm(block.attn_norm, tp_group, **kw,
                                              tags={"layer": i, "site": "attn_norm_grad"})
            # with SP the column-parallel inputs keep their S/T shard and are gathered again
            # in backward, as the GPT's blocks do in the job (Korthikanti et al. 2022 §4.2.2)
            block.attn = ParallelAttention(block.attn, tp_group, r, layer=i, regather=sp, **kw)
            block.mlp_norm = ParallelRMSNorm(block.mlp_norm, tp_group, **kw,
                                             tags={"layer": i, "site": "mlp_norm_grad"})
            block.mlp = ParallelSwiGLU(block.mlp, tp_group, r, layer=i, regather=sp, **kw)
        model.norm = ParallelRMSNorm(model.norm, tp_group, **kw, tags={"site": "norm_grad"})
        if sp:
            cuts.append(lambda x: SplitSequence.apply(x, tp_group))
        blk = model.layers[0]
        info = TensorParallelInfo(
            tp=tp, rank=r, sequence_parallel=sp, regather=sp, seq_divisor=tp if sp else 1,
            vocab_size=0, padded_vocab=0, vocab_start=0, vocab_rows=0, padding_rows=0,
            padding_bytes=0, padding_bytes_total=0, tied=False,
            kv_replicated=blk.attn.kv_replicated, local_heads=blk.attn.n_heads,
            local_kv_heads=blk.attn.n_kv_heads, local_ffn=blk.mlp.w1.weight.shape[0],
            positions_set=False, shards=_shard_specs(model, lambda n: n, 0, tp))
        model.tp_info, model.tp_group = info, tp_group
    if cuts:
        model.shard_tokens = lambda x: _chain(cuts, x)
    if cp > 1 or sp:
        def reduce_pool(s):
            if sp:
                s = reduce_from_tp(s, tp_group, site="vit_pool")
            return SumOverContext.apply(s, cp_group) if cp > 1 else s
        model.reduce_pool = reduce_pool
    model.vit_parallel = types.SimpleNamespace(tp=tp, cp=cp, sequence_parallel=sp)
    return info, core


def _chain(fns, x):
    for f in fns:
        x = f(x)
    return x
