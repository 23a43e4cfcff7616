"""Measuring a run: FLOPs, peak FLOP/s, MFU and memory by category.

* :mod:`labkit.measure.flops` — ``count_flops`` (torch's counter, with CPU attention) and the
  analytic ``6·N + 12·L·A·Q·T`` per token.
* :mod:`labkit.measure.peak` — GPU datasheet peaks and a cached CPU matmul calibration
  (:mod:`labkit.measure.cpu_peak`: with its time and load, measured again when it is old
  or the machine quieter);
  :mod:`labkit.measure.rank_peak` — the peak one rank of a running job divides by.
* :mod:`labkit.measure.mfu` — the lecture's five-step MFU and its rating.
* :mod:`labkit.measure.memory` — bytes by category for one step (torch's ``MemTracker``;
  :mod:`labkit.measure.memory_tracker` holds the tracker).
* :mod:`labkit.measure.layer_activations` — what each layer of the job keeps for backward,
  by part, beside Korthikanti et al.'s count (C18) and labkit's named extra terms.
"""
from labkit.measure.flops import (FlopCount, count_flops, flops_per_token, matmul_params,
                                  sdpa_cpu_flops, transformer_flops_per_token)
from labkit.measure.memory import CATEGORIES, MemoryReport, measure_memory
from labkit.measure.mfu import MFUReport, mfu, mfu_rating
from labkit.measure.peak import (GPU_SPECS, LECTURE_PEAKS, calibrate_cpu_peak,
                                 device_peak_flops, gpu_memory_bandwidth, gpu_peak_flops,
                                 gpu_spec)

__all__ = ["FlopCount", "count_flops", "flops_per_token", "matmul_params", "sdpa_cpu_flops",
           "transformer_flops_per_token", "CATEGORIES", "MemoryReport", "measure_memory",
           "MFUReport", "mfu", "mfu_rating", "GPU_SPECS", "LECTURE_PEAKS",
           "calibrate_cpu_peak", "device_peak_flops", "gpu_memory_bandwidth", "gpu_peak_flops",
           "gpu_spec"]
