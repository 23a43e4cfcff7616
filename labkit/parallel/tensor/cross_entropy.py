"""Vocab-parallel cross-entropy: the loss of vocab-sharded logits, never gathering them.

Megatron-LM's ``vocab_parallel_cross_entropy`` (Shoeybi et al. 2019, §3: "fuse the output
embedding GEMM with the cross-entropy loss … communicating scalar losses instead of logits"):
with rank ``r`` holding logit columns ``[v₀, v₀ + V'/T)`` of token ``n``,

1. ``m_n = max_c z_nc`` — local max, then an all-reduce (max) over the tp group;
2. ``Σ_c exp(z_nc − m_n)``, the target's shifted logit ``z_n,t − m_n`` (on the rank that owns
   ``t``, 0 elsewhere) and, for label smoothing, ``Σ_c (z_nc − m_n)``: one all-reduce (sum)
   of the three ``(N,)`` vectors together;
3. ``loss_n = log Σ exp − (1 − ε)(z_n,t − m_n) − ε · mean_c (z_nc − m_n)``, which is
   ``F.cross_entropy``'s ``(1 − ε)·nll + ε·(−mean_c log p_c)`` (Szegedy et al. 2016, §7).

Subtracting the global max keeps ``exp`` finite for any logits. Backward needs no
communication: ``∂loss_n/∂z_nc = softmax_nc − (1 − ε)[c = t] − ε/V`` on this rank's columns.
Columns at ids ``≥ V`` (vocabulary padding) get ``−∞`` logits: no share of the softmax, no
smoothing term, zero gradient. Targets equal to ``ignore_index`` contribute 0 and are not
counted by ``reduction="mean"`` (as in ``F.cross_entropy``). Bytes per call: 2 all-reduces of
``N`` (max) and ``2`` or ``3·N`` (sums) fp32 elements.
"""
from __future__ import annotations

import torch

from ... import comm
from .functions import AXIS, tp_size

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelLoss"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, ignore_index, smoothing):
        n_local = logits.shape[-1]
        n_real = max(0, min(n_local, vocab_size - vocab_start))
        z = logits.float()
        if n_real < n_local:
            z = z.masked_fill(torch.arange(n_local, device=z.device) >= n_real, float("-inf"))
        zmax = z.amax(dim=-1)
        if tp_size(group) > 1:
            comm.all_reduce(zmax, op="max", group=group, axis=AXIS, site="loss", phase="forward")
        shifted = z - zmax.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < n_real)
        rows = torch.arange(z.shape[0], device=z.device)
        picked = shifted[rows, local_t.clamp(0, n_local - 1)]
        picked = torch.where(mine, picked, torch.zeros_like(picked))  # never -inf·0
        sums = [exp.sum(-1), picked]
        if smoothing > 0:
            sums.append(shifted[:, :n_real].sum(-1))
        sums = torch.stack(sums)
        if tp_size(group) > 1:
            comm.all_reduce(sums, group=group, axis=AXIS, site="loss", phase="forward")
        log_z = sums[0].log()
        loss = log_z - sums[1]
        if smoothing > 0:
            loss = (1 - smoothing) * loss + smoothing * (log_z - sums[2] / vocab_size)
        valid = target != ignore_index
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine, valid)
        ctx.smoothing, ctx.vocab_size, ctx.n_real = smoothing, vocab_size, n_real
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        eps, n_real = ctx.smoothing, ctx.n_real
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        idx = local_t.clamp(0, grad.shape[1] - 1)
        grad[rows, idx] -= (1 - eps) * mine.to(grad.dtype)
        if eps > 0:
            grad[:, :n_real] -= eps / ctx.vocab_size
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None, None


def _targets_in_vocab_cpu(t: torch.Tensor, bad: torch.Tensor, vocab_size: int) -> None:
    """Raises ``ValueError`` naming the first target outside ``[0, vocab_size)``: a host
    read, so only for targets already on the host."""
    if bool(bad.any()):
        raise ValueError(f"target {int(t[bad][0])} is outside the vocabulary [0, {vocab_size})")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, *,
                                 vocab_start: int, vocab_size: int, ignore_index: int = -100,
                                 label_smoothing: float = 0.0,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy (nats) of vocab-sharded logits; equals ``F.cross_entropy`` of the full ones.

    Args:
        logits: ``(…, V'/T)``, this rank's columns ``[vocab_start, vocab_start + V'/T)`` of the
            padded vocabulary (any float dtype; computed in float32).
        targets: int64 ``(…)``, global ids in ``[0, V)`` or ``ignore_index``; the same on
            every tp rank.
        group: the tp process group (``None`` for degree 1).
        vocab_start: the first vocabulary id of this rank's columns.
        vocab_size: the real vocabulary ``V`` (ids ``≥ V`` are padding, masked).
        ignore_index, label_smoothing, reduction: as in ``F.cross_entropy``; ``reduction`` is
            ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"`` (shape of
            ``targets``).

    Raises:
        ValueError: shapes disagree, ``label_smoothing`` outside ``[0, 1]``, unknown
            ``reduction``, or a target outside ``[0, V)`` that is not ``ignore_index``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: "
                         "targets must be the logits' shape without the vocabulary dim")
    t = targets.reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab_size))
    if t.device.type == "cpu":
        _targets_in_vocab_cpu(t, bad, vocab_size)
    else:
        # on a GPU, reading ``bad`` would make the host wait for the device at every call;
        # the device checks it and fails the stream instead, as torch's cross-entropy does
        torch._assert_async(~bad.any(), f"a target is outside the vocabulary [0, {vocab_size})")
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), t,
                                            vocab_start, vocab_size, group, ignore_index,
                                            float(label_smoothing))
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (t != ignore_index).sum()


class VocabParallelLoss:
    """``loss(logits, targets, reduction="mean", *, ignore_index=-100, label_smoothing=0.0)``
    of a tensor-parallel module: :func:`vocab_parallel_cross_entropy` bound to the module's
    tp group and vocabulary shard. Replaces ``GPT``/``StageModule``'s loss."""

    def __init__(self, group, vocab_start: int, vocab_size: int):
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", *,
                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.group,
                                            vocab_start=self.vocab_start,
                                            vocab_size=self.vocab_size,
                                            ignore_index=ignore_index,
                                            label_smoothing=label_smoothing,
                                            reduction=reduction)

    def __repr__(self) -> str:
        return (f"VocabParallelLoss(vocab=[{self.vocab_start}, …) of {self.vocab_size}, "
                f"tp={tp_size(self.group)})")
