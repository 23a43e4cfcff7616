"""Goodput: the share of a cluster's time that trains, given failures and checkpoints —
planned (Young 1974, Daly 2006) and measured (lost work and recovery time per fault).

A job checkpoints every ``τ`` seconds of work, each checkpoint costing ``δ`` seconds;
failures arrive as a Poisson process with mean time between failures ``M``; each costs a
restart of ``R`` seconds plus the work done since the last checkpoint.

* Young (1974), "A first order approximation to the optimum checkpoint interval",
  CACM 17(9): the interval that minimises the expected waste is ``τ* ≈ √(2·δ·M)``.
* Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart
  dumps", FGCS 22(3), §3: with exponential failures the expected wall time to
  finish ``T_s`` seconds of work is ``M·e^{R/M}·(e^{(τ+δ)/M} − 1)·T_s/τ``, so the goodput
  is ``τ / (M·e^{R/M}·(e^{(τ+δ)/M} − 1))``, and the optimum to higher order is
  ``τ* = √(2δM)·[1 + ⅓·√(δ/(2M)) + δ/(18M)] − δ`` for ``δ < 2M`` (else ``M``).

The worked example (:func:`llama3_example`): Llama 3 405B's 54-day pre-training snapshot
had 466 job interruptions, 47 planned and 419 unexpected, 148 of those from faulty GPUs
(Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.4 and Table 5) — an unexpected
interruption every ~3.1 hours on 16k GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["young_interval", "daly_interval", "expected_goodput", "goodput_curve",
           "LLAMA3", "llama3_example", "measured_goodput", "FaultCost"]

#: Llama 3 405B's 54-day snapshot (Dubey et al. 2024, Table 5)
LLAMA3 = {"days": 54, "interruptions": 466, "planned": 47, "unplanned": 419,
          "gpu_faults": 148, "gpus": 16384}


def _check(name: str, v: float, strict: bool = True) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
            or (v <= 0 if strict else v < 0):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} 0, got {v!r}")
    return float(v)


def young_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval ``√(2·δ·M)`` (seconds of work).

    Raises:
        ValueError: ``ckpt_s`` or ``mtbf_s`` not > 0.
    """
    return math.sqrt(2 * _check("ckpt_s", ckpt_s) * _check("mtbf_s", mtbf_s))


def daly_interval(ckpt_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006, §3): ``√(2δM)·[1 + ⅓√(δ/2M) + δ/(18M)] − δ``
    for ``δ < 2M``, else ``M`` (seconds of work)."""
    d, m = _check("ckpt_s", ckpt_s), _check("mtbf_s", mtbf_s)
    if d >= 2 * m:
        return m
    return math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d


def expected_goodput(interval_s: float, ckpt_s: float, mtbf_s: float,
                     restart_s: float = 0.0) -> float:
    """Expected share (0–1) of wall time spent on work that is kept, for checkpoints every
    ``interval_s`` seconds of work costing ``ckpt_s`` each, exponential failures with mean
    ``mtbf_s`` and ``restart_s`` per restart (Daly 2006, §3).

    Raises:
        ValueError: a non-positive interval, checkpoint cost or MTBF, or a negative restart.
    """
    tau, d, m = _check("interval_s", interval_s), _check("ckpt_s", ckpt_s), _check("mtbf_s", mtbf_s)
    r = _check("restart_s", restart_s, strict=False)
    return tau / (m * math.exp(r / m) * math.expm1((tau + d) / m))


def goodput_curve(intervals_s: Sequence[float], ckpt_s: float, mtbf_s: float,
                  restart_s: float = 0.0) -> list:
    """``[(interval, expected goodput)]`` over ``intervals_s``."""
    return [(t, expected_goodput(t, ckpt_s, mtbf_s, restart_s)) for t in intervals_s]


def llama3_example(ckpt_s: float = 60.0, restart_s: float = 600.0,
                   unplanned_only: bool = True) -> dict:
    """The planner on Llama 3's interruption rate.

    Args:
        ckpt_s: seconds to write one checkpoint (an assumption: the paper gives none).
        restart_s: seconds from a failure to training again (an assumption).
        unplanned_only: MTBF from the 419 unexpected interruptions (else all 466).

    Returns:
        ``{"mtbf_s", "young_s", "daly_s", "goodput_at_optimum", "goodput_hourly",
        "interrupts_per_day"}``.
    """
    n = LLAMA3["unplanned"] if unplanned_only else LLAMA3["interruptions"]
    mtbf = LLAMA3["days"] * 86400 / n
    young = young_interval(ckpt_s, mtbf)
    return {"mtbf_s": mtbf, "interrupts_per_day": n / LLAMA3["days"], "young_s": young,
            "daly_s": daly_interval(ckpt_s, mtbf),
            "goodput_at_optimum": expected_goodput(young, ckpt_s, mtbf, restart_s),
            "goodput_hourly": expected_goodput(3600.0, ckpt_s, mtbf, restart_s)}


@dataclass
class FaultCost:
    """What one fault cost a run (seconds).

    Attributes:
        kind: what happened (``"killed"``, ``"hang"`` …).
        rank, step: where.
        detect_s: from the fault to its detection (``None`` if not injected).
        recovery_s: from detection until the restarted pool was running the job again.
        lost_s: work redone: the steps run since the last checkpoint, at the measured
            step time.
        lost_steps: those steps.
    """

    kind: str
    rank: Optional[int]
    step: int
    detect_s: Optional[float]
    recovery_s: float
    lost_s: float
    lost_steps: int


def measured_goodput(useful_s: float, wall_s: float) -> float:
    """Kept work over wall time (0–1).

    Raises:
        ValueError: ``wall_s`` not > 0 or ``useful_s`` negative.
    """
    return _check("useful_s", useful_s, strict=False) / _check("wall_s", wall_s)
