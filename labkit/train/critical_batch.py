"""Steps to a target loss against the batch size: McCandlish et al. 2018's curve (claim C40).

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", §2.3 (eq. 2.11) and
§3.1: to reach a given loss, training at batch ``B`` takes ``S`` steps and ``E = B·S``
examples with

    S / S_min = 1 + B_noise / B          E / E_min = 1 + B / B_noise

``S_min`` the fewest steps any batch can take, ``E_min`` the fewest examples, and
``B_crit = E_min / S_min`` the critical batch, which the gradient noise scale ``B_noise``
(:mod:`labkit.train.noise_scale` measures ``B_simple``) predicts. Below ``B_noise`` a
doubled batch nearly halves the steps; far above it, it saves almost none.

Pure functions over plain lists, no torch:

* :func:`steps_to_target`: the first step at which a run's smoothed training loss reaches a
  target;
* :func:`fit_steps_curve`: ``S_min`` and ``B_crit`` from measured ``(B, S)`` pairs (the
  curve is linear in ``1/B``: ``S = S_min + S_min·B_crit·(1/B)``, least squares);
* :func:`s_min_given_noise`: ``S_min`` alone when ``B_noise`` comes from the noise scale;
* :func:`predicted_steps`: the curve itself.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["smoothed", "steps_to_target", "fit_steps_curve", "s_min_given_noise",
           "predicted_steps"]


def smoothed(losses: Sequence[float], decay: float = 0.9) -> list:
    """Bias-corrected exponential moving average of ``losses`` (as Adam corrects its
    moments, Kingma & Ba 2015 §3): step ``t``'s value is ``Σ_i≤t decay^(t−i)·loss_i /
    Σ_i≤t decay^(t−i)``, so the first value is the first loss and no start-up lag pulls it
    towards zero.

    Raises:
        ValueError: ``decay`` outside ``[0, 1)``.
    """
    if not 0 <= decay < 1:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    out, num, den = [], 0.0, 0.0
    for x in losses:
        num, den = decay * num + float(x), decay * den + 1.0
        out.append(num / den)
    return out


def steps_to_target(losses: Sequence[float], target: float, decay: float = 0.9
                    ) -> Optional[int]:
    """Steps a run needed to reach ``target``: the 1-based index of the first step whose
    smoothed training loss (:func:`smoothed`, ``decay=0`` = raw) is ``<= target``;
    ``None`` if it never did. Units: optimizer steps; losses in nats."""
    for i, v in enumerate(smoothed(losses, decay)):
        if v <= target:
            return i + 1
    return None


def predicted_steps(batch: float, s_min: float, b_noise: float) -> float:
    """``S = S_min·(1 + B_noise/B)`` (McCandlish et al. 2018, eq. 2.11).

    Raises:
        ValueError: ``batch`` not positive.
    """
    if not batch > 0:
        raise ValueError(f"batch must be > 0, got {batch!r}")
    return s_min * (1 + b_noise / batch)


def fit_steps_curve(batches: Sequence[float], steps: Sequence[float]) -> tuple:
    """``(S_min, B_crit)`` of ``S = S_min·(1 + B_crit/B)`` from measured pairs, by least
    squares on the form linear in ``1/B`` (intercept ``S_min``, slope ``S_min·B_crit``).

    Raises:
        ValueError: fewer than two distinct batch sizes, unequal lengths, a non-positive
            batch or step count, or a fit with ``S_min <= 0`` or ``B_crit < 0`` (the steps
            do not fall with the batch as the curve does: no critical batch to read).
    """
    xs, ys = _pairs(batches, steps)
    if len({x for x in xs}) < 2:
        raise ValueError(f"need at least two distinct batch sizes, got {sorted(set(batches))}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    s_min = my - slope * mx
    if not (s_min > 0 and slope >= 0):
        raise ValueError(f"the fit S_min = {s_min:.3g}, S_min·B_crit = {slope:.3g} is not a "
                         f"curve with S_min > 0 and B_crit >= 0: the steps {list(steps)} do "
                         f"not follow S_min·(1 + B_crit/B) over batches {list(batches)}")
    return s_min, slope / s_min


def s_min_given_noise(batches: Sequence[float], steps: Sequence[float],
                      b_noise: float) -> float:
    """``S_min`` minimising ``Σ (S_i − S_min·(1 + B_noise/B_i))²`` for a ``B_noise``
    measured elsewhere (the gradient noise scale): ``Σ S_i·u_i / Σ u_i²``,
    ``u_i = 1 + B_noise/B_i``.

    Raises:
        ValueError: unequal lengths, no pairs, a non-positive batch or step count, or a
            negative ``b_noise``.
    """
    if not (b_noise >= 0 and math.isfinite(b_noise)):
        raise ValueError(f"b_noise must be a finite number >= 0, got {b_noise!r}")
    bs, ss = _check(batches, steps)
    u = [1 + b_noise / b for b in bs]
    return sum(s * w for s, w in zip(ss, u)) / sum(w * w for w in u)


def _check(batches, steps) -> tuple:
    bs, ss = [float(b) for b in batches], [float(s) for s in steps]
    if len(bs) != len(ss) or not bs:
        raise ValueError(f"batches and steps must be equal-length and non-empty, got "
                         f"{len(bs)} and {len(ss)}")
    if min(bs) <= 0 or min(ss) <= 0:
        raise ValueError(f"batches {bs} and steps {ss} must all be > 0")
    return bs, ss


def _pairs(batches, steps) -> tuple:
    bs, ss = _check(batches, steps)
    return [1 / b for b in bs], ss
