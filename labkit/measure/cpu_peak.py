"""The CPU's peak FLOP/s, measured: a matmul loop timed in each rank, shared fairly.

A CPU has no datasheet number torch can reach, so labkit times an ``(n,n)@(n,n)`` matmul
loop and uses that rate as the ceiling MFU divides by (for a GPU,
:mod:`labkit.measure.peak` looks up the datasheet). When ``N`` ranks share a machine, all of
them run the loop at once, as in a real step, and each rank's peak is the *mean* of the N
rates: the machine's aggregate rate split evenly. A single rank's rate is not a ceiling
then: in any window the scheduler may give one rank a whole core while another waits, so
individual readings scatter above and below the fair share, while their sum stays at what
the cores can do.

Results are cached in ``cache_path()`` by CPU model, threads, ranks, matrix size and dtype;
the cache keeps the largest value seen, since other load can only make a reading low.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = ["calibrate_cpu_peak", "cpu_model_name", "cache_path"]


def cpu_model_name() -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo`` (falls back to ``platform.processor``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown-cpu"


def cache_path() -> Path:
    """``$LABKIT_CACHE_DIR/cpu_peak.json``, default ``~/.cache/labkit/cpu_peak.json``."""
    root = os.environ.get("LABKIT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "labkit")
    return Path(root) / "cpu_peak.json"


def _read_cache(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, value: float) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        # a peak is a ceiling: a calibration disturbed by other load reads low, never high,
        # so the cache keeps the best value seen
        old = data.get(key)
        data[key] = max(value, old) if isinstance(old, (int, float)) else value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent ranks never see half a file
    except OSError:
        pass  # a read-only home must not break a measurement


def calibrate_cpu_peak(n: int = 512, seconds: float = 0.3,
                       barrier: Optional[Callable[[], object]] = None, cache: bool = True,
                       ranks: int = 1, dtype: torch.dtype = torch.float32,
                       refresh: bool = False,
                       combine: Optional[Callable[[float], float]] = None) -> float:
    """Measured FLOP/s of an ``(n,n)@(n,n)`` matmul loop in this process, on CPU.

    Runs with the current ``torch.get_num_threads()``: the ceiling a rank of this process
    can reach, which is what MFU on CPU should divide by. When several ranks share the
    machine, each should call this with the same ``ranks`` and a ``barrier`` (e.g.
    ``torch.distributed.barrier``) so all loops run at the same time, as in a real step.

    Args:
        n: matrix side; each matmul is ``2·n³`` FLOP.
        seconds: wall-clock length of the timed loop (after two warm-up matmuls).
        barrier: called once just before the timed loop, on every rank.
        cache: read/write ``cache_path()``, keyed by CPU model, thread count, ``ranks``,
            ``n`` and ``dtype``; a cached value returns at once without calling ``barrier``
            (all ranks share the file, so all of them hit or miss together).
        ranks: how many ranks run the loop concurrently (part of the cache key only).
        refresh: measure even when cached; the cache keeps the larger of the two values.
        combine: called on every rank with its measured rate; returns the value to cache
            and return (e.g. the mean over the ranks, as :func:`labkit.measure.rank_peak.rank_peak_flops` does).

    Returns:
        FLOP/s (float).

    Raises:
        ValueError: if ``n < 1`` or ``seconds <= 0``.
    """
    if n < 1 or seconds <= 0:
        raise ValueError(f"need n >= 1 and seconds > 0, got n={n}, seconds={seconds}")
    key = (f"{cpu_model_name()}|threads={torch.get_num_threads()}|ranks={ranks}|n={n}"
           f"|dtype={str(dtype).removeprefix('torch.')}" + ("|mean" if combine else ""))
    path = cache_path()
    if cache and not refresh:
        hit = _read_cache(path).get(key)
        if isinstance(hit, (int, float)) and hit > 0:
            return float(hit)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=c)
    if barrier is not None:
        barrier()
    # One window for the whole time, not the best of several short ones: when ranks
    # outnumber cores, the time a rank spends descheduled inside the window is exactly the
    # sharing its MFU must be measured against.
    iters = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        torch.mm(a, b, out=c)
        iters += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    flops = 2.0 * n ** 3 * iters / (now - start)
    if combine is not None:
        flops = combine(flops)
    if cache:
        _write_cache(path, key, flops)
    return flops
