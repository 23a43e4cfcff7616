"""The gradient noise scale from data parallelism: how large a batch still pays.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", §2.2 and Appendix
A.1. A batch of ``B`` samples estimates the true gradient ``G`` with
``E|G_B|² = |G|² + tr(Σ)/B`` (``Σ`` the per-sample gradient covariance), so two batch
sizes give unbiased estimates of both terms::

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and ``B_simple = tr(Σ)/|G|²`` — the critical batch size: below it a doubled batch nearly
halves the steps to a target, far above it it saves almost none (``S/S_min = 1 +
B_noise/B``). Each estimate is noisy, so the paper smooths the numerator and the
denominator with separate moving averages before dividing (A.1).

Data parallelism gives both batch sizes for free. Before the reduction a rank's gradient is
its own ``B_small = global_batch/dp`` samples' (labkit's loss is divided by the *global*
token count, so that gradient is ``|G_small|/dp``: it is scaled back by ``dp``); after it,
every rank holds the ``B_big = global_batch`` gradient. One squared norm of each per step,
kept on the device (no host read inside the step), and one untraced all-reduce after
training averages the ranks' ``|G_small|²`` (each rank's is one sample of the estimator).

Supported, with labkit's own data parallelism:

* ZeRO 0 (``dp_mode`` ``"ddp"`` or ``"naive"``): until ``finish_gradient_sync`` copies the
  reduced buckets back, every ``p.grad`` still holds the rank's local accumulation; after
  it, every ``p.grad`` is the whole reduced gradient.
* ZeRO 1: each flat unit's ``flat.grad`` is the rank's full local accumulation until
  ``finish_gradient_sync`` writes the reduced shard into this rank's chunk of it. The
  reduced squared norm is then a sum of shard norms: this rank's chunks (padding is zero)
  per step, summed over the shard group by the same untraced all-reduce after training.

Every other composition is refused before launch (:func:`labkit.validate.validate_run`):
ZeRO 2 drops a unit's full local gradient as soon as its reduce-scatter completes inside
backward (and with several microbatches the local accumulation never exists at all).
"""
from __future__ import annotations

import torch

from .. import comm
from ..parallel.dp import unique_parameters

__all__ = ["EMA", "estimates", "smoothed_b_simple", "NoiseScaleMeter"]

#: decay of the moving averages of ``|G|²`` and ``tr(Σ)`` (A.1 smooths them separately)
EMA = 0.9


def estimates(g_small_sq, g_big_sq, b_small: int, b_big: int) -> tuple:
    """Unbiased ``(|G|², tr(Σ))`` per step from squared gradient norms at two batch sizes
    (McCandlish et al. 2018, A.1, eqs. A.2–A.3).

    Args:
        g_small_sq, g_big_sq: ``(steps,)`` float64 tensors (or sequences): ``|G_small|²``
            at ``b_small`` samples and ``|G_big|²`` at ``b_big``.
        b_small, b_big: batch sizes in samples (sequences for the GPT).

    Returns ``(grad_sq, trace_sigma)``, ``(steps,)`` float64 each; either can come out
    negative on one noisy step (an unbiased estimate is not a positive one).

    Raises:
        ValueError: ``b_small`` not in ``(0, b_big)``.
    """
    if not 0 < b_small < b_big:
        raise ValueError(f"noise scale needs 0 < b_small < b_big, got b_small={b_small}, "
                         f"b_big={b_big}")
    s = torch.as_tensor(g_small_sq, dtype=torch.float64)
    g = torch.as_tensor(g_big_sq, dtype=torch.float64)
    grad_sq = (b_big * g - b_small * s) / (b_big - b_small)
    trace_sigma = (s - g) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace_sigma


def smoothed_b_simple(grad_sq, trace_sigma, decay: float = EMA) -> list:
    """``B_simple`` after each step: EMA(tr Σ) / EMA(|G|²), both averages started at 0
    (Adam's bias correction ``1 − decay^t`` would be the same for both and cancels in the
    ratio). Args: ``(steps,)`` sequences from :func:`estimates`. Returns a list of
    ``steps`` floats, in samples; ``nan`` while the smoothed ``|G|²`` is not positive."""
    out, num, den = [], 0.0, 0.0
    for gs, tr in zip(torch.as_tensor(grad_sq).tolist(), torch.as_tensor(trace_sigma).tolist()):
        num = decay * num + (1 - decay) * tr
        den = decay * den + (1 - decay) * gs
        out.append(num / den if den > 0 else float("nan"))
    return out


def _sq_norm(params: list, device) -> torch.Tensor:
    """``Σ_p |p.grad|²`` as a float64 scalar on ``device`` (a missing gradient is zero)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            total += torch.linalg.vector_norm(p.grad, dtype=torch.float64).square()
    return total


class NoiseScaleMeter:
    """Per step: this rank's local squared gradient norm before the data-parallel reduction
    (:meth:`before_sync`) and the reduced one after it (:meth:`after_sync`).

    ``metrics(ctx)`` (collective over every rank, untraced) returns ``{"b_small",
    "b_big", "g_small_sq" (this rank's, per step), "g_small_sq_mean" (over the data
    ranks), "g_big_sq", "grad_sq", "trace_sigma" (A.1's estimates), "b_simple" (smoothed,
    per step), "b_simple_raw" (per step, unsmoothed)}``; squared norms are of the gradient of
    the mean token loss (nats) over all parameters, batch sizes and ``B_simple`` in samples.
    """

    def __init__(self, setup):
        cfg = setup.cfg
        self.dp = cfg.parallel.dp
        self.b_small, self.b_big = cfg.local_batch, cfg.global_batch
        self.device, self.group = setup.device, setup.mg.group("dp")
        # ZeRO 1's flat units hold their parameters' gradients; the rest are plain tensors
        self.units = [u for w in setup.sharded for u in w.units]
        self.wrapper_of = {id(u): w for w in setup.sharded for u in w.units}
        inside = {id(p) for w in setup.sharded for _, p in unique_parameters(w.module)}
        seen: set = set()
        self.params = []
        for m in setup.stages.values():
            for _, p in unique_parameters(m):
                if id(p) not in seen and id(p) not in inside:
                    seen.add(id(p))
                    self.params.append(p)
        self.small: list = []
        self.big: list = []
        self.big_shards: list = []  # ZeRO 1: this rank's chunks only, summed over ranks later

    def before_sync(self) -> None:
        # the local gradient is of Σ local token losses / global tokens = |G_small|/dp
        local = _sq_norm(self.params + [u.flat for u in self.units], self.device)
        self.small.append(local * self.dp ** 2)

    def after_sync(self) -> None:
        self.big.append(_sq_norm(self.params, self.device))
        shards = torch.zeros((), dtype=torch.float64, device=self.device)
        for u in self.units:
            shards += torch.linalg.vector_norm(self.wrapper_of[id(u)]._step_grad(u),
                                               dtype=torch.float64).square()
        self.big_shards.append(shards)

    def metrics(self, ctx) -> dict:
        own = torch.stack(self.small).cpu()
        sums = torch.stack([own, torch.stack(self.big_shards).cpu()])
        # bookkeeping after training, not the step's traffic: untraced, as the losses are
        enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
        try:
            comm.all_reduce(sums, "sum", self.group)
        finally:
            ctx.tracer.enabled = enabled
        mean = sums[0] / self.dp
        # replicated gradients once, ZeRO 1's shards summed over the ranks (without HSDP
        # the shard group is the whole data group)
        big = torch.stack(self.big).cpu() + sums[1]
        grad_sq, trace_sigma = estimates(mean, big, self.b_small, self.b_big)
        raw = (trace_sigma / grad_sq).tolist()
        return {"b_small": self.b_small, "b_big": self.b_big, "g_small_sq": own.tolist(),
                "g_small_sq_mean": mean.tolist(), "g_big_sq": big.tolist(),
                "grad_sq": grad_sq.tolist(), "trace_sigma": trace_sigma.tolist(),
                "b_simple": smoothed_b_simple(grad_sq, trace_sigma), "b_simple_raw": raw}
