"""Peak FLOP/s of the device a rank runs on: a GPU datasheet table, and a CPU calibration.

MFU divides by a *peak*; a wrong peak makes every MFU wrong, so this module never guesses:
an unknown GPU name gives ``None`` and :func:`labkit.measure.mfu.mfu` then asks for an
explicit number.

GPU numbers are NVIDIA datasheet values, **dense** (no 2:4 sparsity), in FLOP/s; memory
bandwidth in bytes/s (decimal: 1 GB/s = 1e9 B/s). ``"fp32"`` means the non-tensor-core FP32
rate; pass ``"tf32"`` when ``torch.backends.cuda.matmul.allow_tf32`` is on.

A CPU has no datasheet peak that torch can reach, so
:func:`~labkit.measure.cpu_peak.calibrate_cpu_peak` *measures* an fp32 matmul loop instead — which is also the lecture's HFU ceiling (claim C20: even a pure
large matmul reaches only ~80 % of the datasheet peak on an H100; an 8192³ bf16 matmul on an
H200 here ran at 0.80 × 989.4 TFLOP/s).
"""
from __future__ import annotations

import re
from typing import Optional, Union

import torch

from .cpu_peak import cache_path, calibrate_cpu_peak, cpu_model_name

__all__ = ["GPU_SPECS", "LECTURE_PEAKS", "gpu_spec", "gpu_peak_flops", "gpu_memory_bandwidth",
           "calibrate_cpu_peak", "device_peak_flops", "cpu_model_name", "cache_path"]

T = 1e12  # TFLOP/s → FLOP/s
G = 1e9   # GB/s → B/s

#: Datasheet peaks per GPU variant. Keys of ``flops`` are dtype names; values FLOP/s, dense.
GPU_SPECS: dict[str, dict] = {
    "K40": {
        "flops": {"fp32": 4.29 * T, "fp64": 1.43 * T},
        "fp32_boost": 5.04 * T,
        "bandwidth": 288 * G,
        "source": "NVIDIA Tesla K40 datasheet (2013): 4.29 TFLOP/s fp32 at the 745 MHz base "
                  "clock; 2880 cores x 2 x 875 MHz boost = 5.04 TFLOP/s, the lecture's "
                  "'about 5' (claim C1)",
    },
    "A100-SXM4-40GB": {
        "flops": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T,
                  "fp64": 19.5 * T},
        "bandwidth": 1555 * G,
        "source": "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s bf16/fp16 dense, "
                  "19.5 fp32, 1,555 GB/s HBM2 (40 GB)",
    },
    "A100-SXM4-80GB": {
        "flops": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T,
                  "fp64": 19.5 * T},
        "bandwidth": 2039 * G,
        "source": "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e (80 GB SXM)",
    },
    "A100-PCIE-40GB": {
        "flops": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
        "bandwidth": 1555 * G,
        "source": "NVIDIA A100 datasheet (PCIe 40 GB): 312 TFLOP/s bf16, 1,555 GB/s",
    },
    "A100-PCIE-80GB": {
        "flops": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
        "bandwidth": 1935 * G,
        "source": "NVIDIA A100 datasheet (PCIe 80 GB): 312 TFLOP/s bf16, 1,935 GB/s",
    },
    "H100-SXM": {
        "flops": {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "tf32": 494.7 * T,
                  "fp32": 67 * T, "fp64": 67 * T},
        "bandwidth": 3352 * G,
        "source": "NVIDIA H100 datasheet (SXM5 80 GB): 989.4 TFLOP/s bf16 dense (1,979 with "
                  "sparsity), 67 fp32, 3.35 TB/s HBM3 (3,352 GB/s in the lecture, claim C2)",
    },
    "H100-PCIE": {
        "flops": {"bf16": 756.5 * T, "fp16": 756.5 * T, "fp8": 1513 * T, "tf32": 378 * T,
                  "fp32": 51 * T, "fp64": 51 * T},
        "bandwidth": 2039 * G,
        "source": "NVIDIA H100 datasheet (PCIe 80 GB): 1,513 TFLOP/s bf16 with sparsity -> "
                  "756.5 dense, 51 fp32, 2 TB/s HBM2e",
    },
    "H100-NVL": {
        "flops": {"bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T, "tf32": 417.5 * T,
                  "fp32": 60 * T, "fp64": 60 * T},
        "bandwidth": 3900 * G,
        "source": "NVIDIA H100 NVL datasheet: 1,671 TFLOP/s bf16 with sparsity -> 835.5 "
                  "dense, 60 fp32, 3.9 TB/s",
    },
    "H200-SXM": {
        "flops": {"bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T, "tf32": 494.7 * T,
                  "fp32": 67 * T, "fp64": 67 * T},
        "bandwidth": 4800 * G,
        "source": "NVIDIA H200 datasheet (SXM 141 GB): same GH100 compute as H100 SXM, "
                  "989.4 TFLOP/s bf16 dense, 4.8 TB/s HBM3e",
    },
    "H200-NVL": {
        "flops": {"bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T, "tf32": 417.5 * T,
                  "fp32": 60 * T, "fp64": 60 * T},
        "bandwidth": 4800 * G,
        "source": "NVIDIA H200 NVL datasheet: 1,671 TFLOP/s bf16 with sparsity -> 835.5 "
                  "dense, 60 fp32, 4.8 TB/s",
    },
    "B200": {
        "flops": {"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T, "tf32": 1100 * T,
                  "fp32": 75 * T},
        "bandwidth": 7700 * G,
        "source": "NVIDIA HGX B200 datasheet (1,000 W): 4.5 PFLOP/s bf16 and 9 fp8 with "
                  "sparsity -> 2.25 / 4.5 dense, 75 TFLOP/s fp32, 7.7 TB/s. The B200 in a "
                  "GB200 NVL72 (1,200 W) reaches 5 PFLOP/s dense fp8, the lecture's figure",
    },
}

#: The three peaks of the lecture's growth slide (claim C1), as the lecture states them.
LECTURE_PEAKS: dict[str, tuple[str, str, float]] = {
    "K40": ("2013", "fp32", 5 * T),
    "H100": ("2022", "bf16", 989 * T),
    "B200": ("2024", "fp8", 5000 * T),
}

# (pattern on the upper-cased torch.cuda.get_device_name(), table key); first match wins.
_NAME_RULES: list[tuple[str, str]] = [
    (r"\bK40", "K40"),
    (r"A100.*SXM.*80\s*GB|A100.*80\s*GB.*SXM", "A100-SXM4-80GB"),
    (r"A100.*SXM.*40\s*GB|A100.*40\s*GB.*SXM", "A100-SXM4-40GB"),
    (r"A100.*PCIE.*80\s*GB|A100.*80\s*GB.*PCIE", "A100-PCIE-80GB"),
    (r"A100.*PCIE.*40\s*GB|A100.*40\s*GB.*PCIE", "A100-PCIE-40GB"),
    (r"H100.*NVL", "H100-NVL"),
    (r"H100.*PCIE", "H100-PCIE"),
    (r"H100.*(SXM|HBM3)", "H100-SXM"),
    (r"H200.*NVL", "H200-NVL"),
    (r"^(NVIDIA\s+)?H200(\s+SXM)?(\s+\d+\s*GB(\s+HBM3E)?)?$", "H200-SXM"),
    (r"^(NVIDIA\s+)?B200(\s+\d+\s*GB(\s+HBM3E)?)?$", "B200"),
]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.float64: "fp64"}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
            "float": "fp32", "float64": "fp64", "double": "fp64", "float8": "fp8"}


def _dtype_key(dtype: Union[str, torch.dtype]) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES:
            return _DTYPES[dtype]
        if "float8" in str(dtype):
            return "fp8"
        raise ValueError(f"no peak for dtype {dtype}")
    d = str(dtype).lower().removeprefix("torch.")
    return _ALIASES.get(d, d)


def gpu_spec(name: str) -> Optional[tuple[str, dict]]:
    """``(table key, spec dict)`` for a ``torch.cuda.get_device_name()`` string, else ``None``.

    Matches e.g. ``"NVIDIA H100 80GB HBM3"`` → ``"H100-SXM"``, ``"NVIDIA H200"`` →
    ``"H200-SXM"``, ``"NVIDIA A100-SXM4-80GB"``. A name that does not identify one variant
    (e.g. a bare ``"NVIDIA A100"`` whose memory decides the bandwidth) gives ``None``.
    """
    up = " ".join(str(name).upper().split())
    for key in GPU_SPECS:
        if up == key.upper():
            return key, GPU_SPECS[key]
    for pattern, key in _NAME_RULES:
        if re.search(pattern, up):
            return key, GPU_SPECS[key]
    return None


def gpu_peak_flops(name: str, dtype: Union[str, torch.dtype] = "bf16") -> Optional[float]:
    """Dense datasheet peak in FLOP/s for a GPU name and dtype; ``None`` when unknown.

    ``name`` is a ``torch.cuda.get_device_name()`` string or a table key (``"H100-SXM"``);
    ``dtype`` is ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"tf32"``, ``"fp32"``, ``"fp64"`` or the
    torch dtype. Unknown GPU or a dtype the datasheet does not list → ``None``, never a guess.
    """
    hit = gpu_spec(name)
    if hit is None:
        return None
    try:
        return hit[1]["flops"].get(_dtype_key(dtype))
    except ValueError:
        return None


def gpu_memory_bandwidth(name: str) -> Optional[float]:
    """Datasheet memory bandwidth in bytes/s (decimal) for a GPU name; ``None`` when unknown."""
    hit = gpu_spec(name)
    return None if hit is None else hit[1]["bandwidth"]


def device_peak_flops(device: Union[torch.device, str],
                      dtype: Union[str, torch.dtype] = torch.float32,
                      **calibrate_kwargs) -> Optional[float]:
    """Peak FLOP/s for ``device``: datasheet for CUDA, calibration for CPU, else ``None``.

    CUDA: :func:`gpu_peak_flops` of ``torch.cuda.get_device_name(device)`` (``None`` for a
    GPU not in the table). CPU: :func:`calibrate_cpu_peak` with ``dtype`` and
    ``calibrate_kwargs`` (``ranks=``, ``barrier=``, ``cache=``...).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(dev), dtype)
    if dev.type == "cpu":
        if isinstance(dtype, str):
            inv = {v: k for k, v in _DTYPES.items()}
            dtype = inv.get(_dtype_key(dtype), torch.float32)
        return calibrate_cpu_peak(dtype=dtype, **calibrate_kwargs)
    return None
