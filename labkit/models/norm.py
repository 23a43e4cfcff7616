"""RMSNorm that keeps for backward only its input, in the input's own dtype, and ``1/rms``.

``y = cast(x·r) · g`` with ``r = 1/sqrt(mean(x²) + eps)`` taken in float32 (Zhang & Sennrich
2019, eq. 4). Written as plain autograd ops, a bf16 input would leave three tensors behind for
backward: the float32 copy ``x.float()`` (4 bytes per element), the normalised ``cast(x·r)``
(needed for ``g``'s gradient) and ``r``. Megatron-LM's fused norm keeps the 16-bit input and
the per-token statistic and recomputes the rest in backward, which is what Korthikanti et
al. 2022 (§4.1) count as a norm's activations (``2·S·B·H`` bytes, the statistic being
negligible). :func:`rms_norm` does the same: it saves ``x`` as given and ``r``
(float32, one per token), and upcasts ``x`` again in backward.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "rms_norm"]


class _RMSNormFunction(torch.autograd.Function):
    """Forward and backward of RMSNorm from ``(x, r)``; the values are those of the plain
    ops (``xf = x.float(); xf·r`` cast back to ``x``'s dtype, times the weight, with torch's
    type promotion), the gradients theirs up to rounding order."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return (xf * r).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, r, weight = ctx.saved_tensors
        n = x.float() * r                   # the normalised input, rebuilt in float32
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (grad * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            # as autograd's mul and casts would: the normalised output's gradient in x's
            # dtype, then float32 through the statistic
            gn = (grad * weight).to(x.dtype).float()
            gx = (r * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``(…, H)`` by ``weight`` ``(H,)``: same shape, dtype as torch's
    promotion of ``x`` and ``weight`` gives. Saves ``x`` and float32 ``1/rms`` ``(…, 1)``."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, eq. 4): ``x / rms(x) * g``.

    Input ``(..., H)``, output same shape (dtype: ``x``'s promoted with the weight's). The
    statistic is taken in float32 so that bf16/fp16 activations do not lose the
    small-variance tail; backward keeps ``x`` as given and the statistic (:func:`rms_norm`).
    """

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
