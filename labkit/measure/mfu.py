"""Model FLOPs Utilization (MFU) in the lecture's five steps (claims C21, C22).

MFU (PaLM, Chowdhery et al. 2022, §4.1 and Appendix B) asks how much of the hardware's peak
went into the model's *useful* math. The CS231N lecture (slide 115) computes it in five steps:

1. count the matmul FLOPs of one forward + backward (backward ≈ 2× forward; element-wise
   ops such as nonlinearities, norms and residual adds are ignored);
2. look up the peak FLOP/s of the device (H100: 989 TFLOP/s bf16) — **of every device the
   step ran on**;
3. theoretical time = FLOPs ÷ peak;
4. measure the real time of one whole iteration (data loading, forward, backward,
   optimizer update);
5. MFU = theoretical time ÷ measured time.

HFU (hardware FLOPs utilization) is the same ratio with the FLOPs the hardware actually ran,
including recomputation from activation checkpointing, so HFU ≥ MFU. The lecture's bars:
MFU above 30 % is good, above 40 % excellent (claim C22).

The classic mistake is step 2 with one device's peak: a job on 16 GPUs that did 2.84 % of
what the cluster could do looks like 45.4 %. ``n_devices`` is therefore a required argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["MFUReport", "mfu", "mfu_rating"]


@dataclass(frozen=True)
class MFUReport:
    """The five steps' numbers.

    Attributes:
        model_flops: model FLOPs of the step (FLOP).
        hardware_flops: FLOPs the hardware ran, recomputation included (FLOP); equal to
            ``model_flops`` when none was given.
        peak_total: peak of all devices together, ``n_devices · peak per device`` (FLOP/s).
        theoretical_time_s: ``model_flops / peak_total`` (s).
        measured_time_s: the measured step time (s).
        mfu: ``theoretical_time_s / measured_time_s`` (fraction, not percent).
        hfu: ``hardware_flops / (peak_total · measured_time_s)`` (fraction).
        n_devices: devices the step ran on.
    """

    model_flops: float
    hardware_flops: float
    peak_total: float
    theoretical_time_s: float
    measured_time_s: float
    mfu: float
    hfu: float
    n_devices: int = 1

    @property
    def achieved_flops(self) -> float:
        """Model FLOP/s actually delivered, all devices together."""
        return self.model_flops / self.measured_time_s

    @property
    def one_device_mistake(self) -> float:
        """What MFU would wrongly read if divided by a single device's peak (``mfu · n``)."""
        return self.mfu * self.n_devices

    @property
    def rating(self) -> str:
        """:func:`mfu_rating` of :attr:`mfu`."""
        return mfu_rating(self.mfu)


def mfu(model_flops_per_step: float, step_time_s: float,
        peak_flops_per_device: Optional[float], n_devices: int,
        hardware_flops_per_step: Optional[float] = None) -> MFUReport:
    """MFU and HFU of a training step (or any span: FLOPs and time must cover the same work).

    Args:
        model_flops_per_step: model FLOPs of the step over *all* devices, e.g.
            ``6 · N · tokens`` or :func:`labkit.measure.flops.transformer_flops_per_token`
            × tokens (FLOP).
        step_time_s: measured wall-clock seconds of the step.
        peak_flops_per_device: peak FLOP/s of one device (:func:`labkit.measure.peak
            .device_peak_flops`); ``None`` (an unknown device) is refused.
        n_devices: devices that shared the work. Required: dividing by one device's peak is
            the classic mistake.
        hardware_flops_per_step: FLOPs actually run including recomputation; default
            ``model_flops_per_step`` (no recomputation, HFU = MFU).

    Returns:
        :class:`MFUReport`.

    Raises:
        ValueError: ``"unknown device: pass an explicit peak"`` if the peak is ``None``; also
            for a non-positive peak, time or device count, or negative FLOPs.
    """
    if peak_flops_per_device is None:
        raise ValueError("unknown device: pass an explicit peak (FLOP/s per device)")
    if peak_flops_per_device <= 0:
        raise ValueError(f"peak_flops_per_device must be > 0, got {peak_flops_per_device}")
    if isinstance(n_devices, bool) or int(n_devices) != n_devices or n_devices < 1:
        raise ValueError(f"n_devices must be a positive integer, got {n_devices!r}")
    if step_time_s <= 0:
        raise ValueError(f"step_time_s must be > 0, got {step_time_s}")
    if model_flops_per_step < 0:
        raise ValueError(f"model_flops_per_step must be >= 0, got {model_flops_per_step}")
    hw = model_flops_per_step if hardware_flops_per_step is None else hardware_flops_per_step
    if hw < 0:
        raise ValueError(f"hardware_flops_per_step must be >= 0, got {hw}")
    n = int(n_devices)
    peak_total = float(peak_flops_per_device) * n              # step 2, all devices
    theoretical = model_flops_per_step / peak_total            # step 3
    return MFUReport(model_flops=float(model_flops_per_step), hardware_flops=float(hw),
                     peak_total=peak_total, theoretical_time_s=theoretical,
                     measured_time_s=float(step_time_s),       # step 4
                     mfu=theoretical / step_time_s,            # step 5
                     hfu=(hw / peak_total) / step_time_s, n_devices=n)


def mfu_rating(x: float) -> str:
    """The lecture's bar (claim C22): ``"excellent"`` if MFU > 0.40, ``"good"`` if > 0.30,
    else ``"low"``. ``x`` is a fraction (0.35 for 35 %)."""
    if x > 0.40:
        return "excellent"
    if x > 0.30:
        return "good"
    return "low"
