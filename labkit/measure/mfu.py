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

Why a newer GPU can show a *lower* MFU (claim C23): from A100 to H100 the bf16 peak grew 3.1×
but memory bandwidth only 2.1× (:func:`hardware_generation`). Work that streams memory
(element-wise ops, norms, optimizer) speeds up by the bandwidth ratio, matmuls by the FLOP
ratio, so the memory-bound share of the step grows (:func:`roofline_mfu`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["MFUReport", "mfu", "mfu_rating", "hardware_generation", "roofline_mfu"]


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
            for a non-positive peak, time or device count, or negative FLOPs; and when MFU or
            HFU exceeds 100 %, naming the numbers: no step runs faster than its peak, so the
            peak is not a ceiling (e.g. a CPU calibration taken on a busy machine) or the
            FLOPs or the time do not cover the same work. Such a result is an error in the
            inputs, never a rating.
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
    top = max(hw, model_flops_per_step)
    if top / peak_total > step_time_s:
        what = "MFU" if model_flops_per_step >= hw else "HFU"
        raise ValueError(
            f"{what} {100 * top / peak_total / step_time_s:.1f} % > 100 %: {top:.4g} FLOP in "
            f"{step_time_s:.4g} s on {n} device(s) of peak {float(peak_flops_per_device):.4g} "
            f"FLOP/s each is faster than the peak; the peak is not a ceiling, or the FLOPs and "
            f"the time do not cover the same work")
    return MFUReport(model_flops=float(model_flops_per_step), hardware_flops=float(hw),
                     peak_total=peak_total, theoretical_time_s=theoretical,
                     measured_time_s=float(step_time_s),       # step 4
                     mfu=theoretical / step_time_s,            # step 5
                     hfu=(hw / peak_total) / step_time_s, n_devices=n)


def mfu_rating(x: float) -> str:
    """The lecture's bar (claim C22): ``"excellent"`` if MFU > 0.40, ``"good"`` if > 0.30,
    else ``"low"``. ``x`` is a fraction (0.35 for 35 %).

    Raises:
        ValueError: ``x > 1``: an MFU above 100 % is an error in the inputs (see :func:`mfu`),
            not an excellent run.
    """
    if x > 1.0:
        raise ValueError(f"MFU {100 * x:.1f} % > 100 % is an error in the inputs (a peak that "
                         f"is not a ceiling, or FLOPs and time of different work), not a rating")
    if x > 0.40:
        return "excellent"
    if x > 0.30:
        return "good"
    return "low"


def hardware_generation(old: str, new: str, dtype: str = "bf16") -> dict:
    """Compare two GPUs of :data:`labkit.measure.peak.GPU_SPECS` (claim C23 as data).

    Returns ``{"flops_ratio", "bandwidth_ratio", "ridge_old", "ridge_new"}``: peak and
    bandwidth of ``new`` over ``old``, and each device's ridge point ``peak / bandwidth`` in
    FLOP per byte (a kernel doing fewer FLOPs per byte moved is memory-bound there).
    ``hardware_generation("A100-SXM4-40GB", "H100-SXM")`` → 3.17×, 2.16×, 200.6, 295.2.

    Raises:
        ValueError: a name the table does not know, or no ``dtype`` peak (never a guess).
    """
    from .peak import gpu_memory_bandwidth, gpu_peak_flops

    vals = {}
    for tag, name in (("old", old), ("new", new)):
        peak, bw = gpu_peak_flops(name, dtype), gpu_memory_bandwidth(name)
        if peak is None or bw is None:
            raise ValueError(f"no {dtype} peak/bandwidth for GPU {name!r}: pass a table key such "
                             "as 'A100-SXM4-40GB' or 'H100-SXM'")
        vals[tag] = (peak, bw)
    (p0, b0), (p1, b1) = vals["old"], vals["new"]
    return {"flops_ratio": p1 / p0, "bandwidth_ratio": b1 / b0, "ridge_old": p0 / b0,
            "ridge_new": p1 / b1}


def roofline_mfu(model_flops: float, bytes_moved: float, peak_flops: float,
                 bandwidth: float) -> float:
    """Best-case MFU of a step whose matmuls run at peak and whose memory-bound work (moving
    ``bytes_moved`` bytes, not overlapped) runs at full bandwidth:
    ``(F / peak) / (F / peak + M / bandwidth)``. FLOP, bytes, FLOP/s, bytes/s.

    Raises:
        ValueError: non-positive peak or bandwidth, or negative work.
    """
    if peak_flops <= 0 or bandwidth <= 0 or model_flops < 0 or bytes_moved < 0:
        raise ValueError(f"need peak, bandwidth > 0 and work >= 0, got {peak_flops}, "
                         f"{bandwidth}, {model_flops}, {bytes_moved}")
    compute = model_flops / peak_flops
    total = compute + bytes_moved / bandwidth
    return compute / total if total else 0.0
