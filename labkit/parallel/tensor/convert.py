"""Turn a built full-weight ``GPT`` or pipeline ``StageModule`` into its tensor-parallel shard.

:func:`apply_tensor_parallel` is the interface the training job calls (after the pipeline
split, before context parallelism, checkpointing and data parallelism). It replaces, in
place, the children that Megatron-LM splits (Shoeybi et al. 2019, §3; Korthikanti et al.
2022, §4.2.2 for sequence parallelism), slicing the full weights every rank built from the
same seed, so the shard is exactly a piece of the reference model:

==========================  ==========================================================
``tok_emb``                 :class:`VocabParallelEmbedding` (vocabulary rows, padded)
``layers[i].attn_norm``     :class:`ParallelRMSNorm` (weight summed over tp with SP)
``layers[i].attn``          :class:`ParallelAttention` (``wq,wk,wv`` column, ``wo`` row)
``layers[i].mlp_norm``      :class:`ParallelRMSNorm`
``layers[i].mlp``           :class:`ParallelSwiGLU` (``w1,w3`` column, ``w2`` row)
``norm``                    :class:`ParallelRMSNorm`
``head``                    :class:`VocabParallelHead` (logits stay vocab-sharded)
``loss``                    :class:`VocabParallelLoss`
==========================  ==========================================================

Parameter names do not change, so :func:`gather_full` can rebuild full tensors under the
full GPT's names for parity checks.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ... import comm
from ...models.gpt import GPT, SwiGLU
from .attention import ParallelAttention, ParallelSwiGLU
from .check import check_tensor_parallel
from .cross_entropy import VocabParallelLoss
from .functions import AXIS, tp_rank, tp_size
from .layers import ColumnParallelLinear, ParallelRMSNorm, RowParallelLinear
from .vocab import VocabParallelEmbedding, VocabParallelHead, padding, shard_vocab

__all__ = ["TensorParallelInfo", "apply_tensor_parallel", "gather_full", "check_tensor_parallel"]


@dataclass
class TensorParallelInfo:
    """What a job needs to know about a module after :func:`apply_tensor_parallel`.

    Attributes:
        tp, rank: degree and this rank's index in the tp group.
        sequence_parallel, regather: the options applied.
        seq_divisor: the residual stream between blocks (and a pipeline stage's boundary
            activation) is ``(B, S/seq_divisor, H)``: ``tp`` with sequence parallelism, else 1.
        vocab_size, padded_vocab: ``V`` and ``V'`` (a multiple of ``tp``).
        vocab_start, vocab_rows: this rank's vocabulary rows ``[start, start + rows)``.
        padding_rows: padding rows on this rank; ``padding_bytes`` their parameter bytes
            (embedding and head each, once when tied); ``padding_bytes_total`` over all
            ranks. Gradients and each AdamW moment add as much again.
        tied: the embedding and the head are one Parameter on this rank.
        kv_replicated: ``kv_heads < tp`` (full ``wk``/``wv`` on every rank).
        local_heads, local_kv_heads, local_ffn: this rank's share.
        positions_set: ``module.positions`` was set so rotary covers the full sequence.
        shards: ``{local parameter name: (full name, dim, full size)}``; ``dim`` ``None`` =
            whole on every rank.
    """

    tp: int
    rank: int
    sequence_parallel: bool
    regather: bool
    seq_divisor: int
    vocab_size: int
    padded_vocab: int
    vocab_start: int
    vocab_rows: int
    padding_rows: int
    padding_bytes: int
    padding_bytes_total: int
    tied: bool
    kv_replicated: bool
    local_heads: int
    local_kv_heads: int
    local_ffn: int
    positions_set: bool
    shards: dict = field(default_factory=dict)

    def boundary_shape(self, b: int, s: int, h: int) -> tuple:
        """Shape of the activation between blocks/stages for a ``(b, s)`` batch."""
        return (b, s // self.seq_divisor, h)


def _forward_with_sharded_loss(self, idx: torch.Tensor, targets=None) -> torch.Tensor:
    """GPT.forward with the vocab-parallel loss: ``F.cross_entropy`` on a vocabulary shard
    would be silently wrong."""
    logits = type(self).forward(self, idx)
    if targets is None:
        return logits
    if targets.shape != idx.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}")
    return self.loss(logits, targets, "mean")


def apply_tensor_parallel(module: nn.Module, group, *, sequence_parallel: bool = False,
                          regather: bool = False, seq_len: int | None = None
                          ) -> TensorParallelInfo:
    """Shard ``module`` (a full-weight ``GPT`` or ``StageModule``) over the tp ``group``, in place.

    Args:
        module: built with full weights (``build_model``/``build_stages``); a first or last
            pipeline stage may lack ``tok_emb`` or ``norm``/``head``.
        group: the tp process group; ``None`` for degree 1 (the same layers, no
            communication).
        sequence_parallel: norms run on ``S/T`` tokens; the residual stream is
            ``(B, S/T, H)`` (Korthikanti et al. 2022). The input ids stay ``(B, S)``.
        regather: with sequence parallelism, column-parallel matmuls keep only the ``S/T``
            input shard for backward and all-gather it again there (less activation memory,
            one more all-gather per region in backward).
        seq_len: the sequence attention sees, for rotary positions of a ``StageModule`` with
            sequence parallelism (default: the rotary table's length, ``cfg.seq_len``).

    After the call ``module(idx)`` returns vocab-sharded logits ``(B, S, V'/T)``,
    ``module.loss(logits, targets, reduction)`` is the vocab-parallel cross-entropy, and
    ``GPT.forward(idx, targets)`` returns it (mean). ``attn.core`` stays a hook; it receives
    this rank's heads. Every tp rank computes the same loss (do not sum it over tp), and after
    backward every gradient is complete on its rank, including those of the weights held
    whole (sequence-parallel norms, replicated K/V): nothing is left to reduce over tp. A
    stage converted with sequence parallelism expects sequences of ``seq_len`` tokens.

    Returns:
        :class:`TensorParallelInfo`.

    Raises:
        ValueError: heads, K/V heads, ffn width or (with sequence parallelism) ``seq_len`` do
            not split over the group (see :func:`check_tensor_parallel`); ``regather``
            without ``sequence_parallel``; the module was converted already.
    """
    n, rank = tp_size(group), tp_rank(group)
    if regather and not sequence_parallel:
        raise ValueError("regather applies to sequence parallelism only")
    if getattr(module, "tp_info", None) is not None:
        raise ValueError("module is tensor-parallel already")
    layers = list(module.layers)
    emb, head = getattr(module, "tok_emb", None), getattr(module, "head", None)
    table = emb if emb is not None else head
    vocab, hidden = (table.weight.shape if table is not None else (0, 0))
    if layers:
        attn = layers[0].attn
        s = seq_len if seq_len is not None else module.rope_cos.shape[0]
        dense = isinstance(layers[0].mlp, SwiGLU)
        shape = types.SimpleNamespace(kind="gpt", n_heads=attn.n_heads, kv_heads=attn.n_kv_heads,
                                      ffn_dim=layers[0].mlp.w1.weight.shape[0] if dense else n,
                                      seq_len=s)
        check_tensor_parallel(shape, n, sequence_parallel, s)
    full_name = getattr(module, "full_name", lambda name: name)
    layer_ids = getattr(module, "layer_ids", list(range(len(layers))))
    sp = dict(sequence_parallel=sequence_parallel)

    per = -(-vocab // n) if vocab else 0
    start = rank * per
    tied = emb is not None and head is not None and head.weight is emb.weight
    if emb is not None:
        w = nn.Parameter(shard_vocab(emb.weight, n, rank))
        module.tok_emb = VocabParallelEmbedding(w, start, group, **sp)
    if head is not None:
        w = module.tok_emb.weight if tied else nn.Parameter(shard_vocab(head.weight, n, rank))
        module.head = VocabParallelHead(w, start, group, regather=regather, **sp)
    for i, block in zip(layer_ids, layers):
        block.attn_norm = ParallelRMSNorm(block.attn_norm, group, **sp,
                                          tags={"layer": i, "site": "attn_norm_grad"})
        block.attn = ParallelAttention(block.attn, group, rank, regather=regather, layer=i, **sp)
        block.mlp_norm = ParallelRMSNorm(block.mlp_norm, group, **sp,
                                         tags={"layer": i, "site": "mlp_norm_grad"})
        if isinstance(block.mlp, SwiGLU):
            block.mlp = ParallelSwiGLU(block.mlp, group, rank, regather=regather, layer=i, **sp)
        elif sequence_parallel:
            raise ValueError("sequence parallelism with mixture-of-experts layers: the experts "
                             "would see a different S/tp slice on each tp rank; use "
                             "sequence_parallel=False (experts are replicated over tp)")
        # a mixture-of-experts layer stays whole on every tp rank: the same tokens, the same
        # experts, the same gradients (expert parallelism splits the experts instead)
    if getattr(module, "norm", None) is not None:
        module.norm = ParallelRMSNorm(module.norm, group, **sp, tags={"site": "norm_grad"})
    module.loss = VocabParallelLoss(group, start, vocab)
    if isinstance(module, GPT):
        module.forward = types.MethodType(_forward_with_sharded_loss, module)
    positions_set = False
    if sequence_parallel and not isinstance(module, GPT) and module.positions is None:
        # a stage reads its rotary rows from the residual stream's length, S/T here
        s = seq_len if seq_len is not None else module.rope_cos.shape[0]
        module.positions = torch.arange(s, device=module.rope_cos.device)
        positions_set = True

    elem = table.weight.element_size() if table is not None else 4
    pad = padding(vocab, hidden, n, rank, bytes_per_elem=elem) if vocab else \
        {"padded_vocab": 0, "rows": 0, "bytes": 0, "total_bytes": 0}
    tables = (emb is not None) + (head is not None and not tied)
    blk = layers[0] if layers else None
    info = TensorParallelInfo(
        tp=n, rank=rank, sequence_parallel=sequence_parallel, regather=regather,
        seq_divisor=n if sequence_parallel else 1, vocab_size=vocab,
        padded_vocab=pad["padded_vocab"], vocab_start=start, vocab_rows=per,
        padding_rows=pad["rows"], padding_bytes=pad["bytes"] * tables,
        padding_bytes_total=pad["total_bytes"] * tables, tied=tied,
        kv_replicated=bool(blk and blk.attn.kv_replicated),
        local_heads=blk.attn.n_heads if blk else 0,
        local_kv_heads=blk.attn.n_kv_heads if blk else 0,
        local_ffn=blk.mlp.w1.weight.shape[0] if blk and isinstance(blk.mlp, SwiGLU) else 0,
        positions_set=positions_set,
        shards=_shard_specs(module, full_name, vocab, n))
    module.tp_info, module.tp_group = info, group
    return info


def _shard_specs(module: nn.Module, full_name, vocab: int, n: int) -> dict:
    """``{name: (full name, dim, full size)}`` from the type of each parameter's owner."""
    specs = {}
    for name, p in module.named_parameters():
        owner = module.get_submodule(name.rpartition(".")[0])
        dim = size = None
        if isinstance(owner, (VocabParallelEmbedding, VocabParallelHead)):
            dim, size = 0, vocab
        elif isinstance(owner, ColumnParallelLinear):
            dim, size = 0, p.shape[0] * n
        elif isinstance(owner, RowParallelLinear) and p.dim() == 2:  # its bias is whole
            dim, size = 1, p.shape[1] * n
        specs[name] = (full_name(name), dim, size)
    return specs


def gather_full(module: nn.Module, what: str = "param") -> dict:
    """This rank's parameters (``what="param"``) or gradients (``"grad"``) rebuilt to the full
    model's shapes, under the full GPT's names: ``{name: CPU float tensor}``.

    Split tensors are all-gathered over the tp group through :mod:`labkit.comm` (every tp rank
    must call this together); vocabulary padding is dropped. A parameter without a gradient
    maps to ``None``. For parity checks, not for training.

    Raises:
        ValueError: ``module`` was not converted, or ``what`` is unknown.
    """
    info = getattr(module, "tp_info", None)
    if info is None:
        raise ValueError("module is not tensor-parallel (apply_tensor_parallel first)")
    if what not in ("param", "grad"):
        raise ValueError(f"what must be 'param' or 'grad', got {what!r}")
    group = module.tp_group
    out = {}
    for name, p in module.named_parameters():
        full, dim, size = info.shards[name]
        t = p.detach() if what == "param" else p.grad
        if t is None:
            out[full] = None
            continue
        if dim is not None and info.tp > 1:
            t = t.transpose(0, dim).contiguous() if dim else t.contiguous()
            buf = torch.empty((info.tp * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype,
                              device=t.device)
            comm.all_gather(buf, t, group=group, axis=AXIS, site="gather")
            t = buf
            t = t.transpose(0, dim) if dim else t
        if dim is not None:
            t = t.narrow(dim, 0, size)
        out[full] = t.detach().float().cpu().clone()
    return out
