"""The CPU's peak FLOP/s, measured: a matmul loop timed in each rank, shared fairly, kept a
ceiling.

A CPU has no datasheet number torch can reach, so labkit times an ``(n,n)@(n,n)`` matmul
loop and uses that rate as the ceiling MFU divides by (for a GPU,
:mod:`labkit.measure.peak` looks up the datasheet). When ``N`` ranks share a machine, all of
them run the loop at once, as in a real step, and each rank's peak is the *mean* of the N
rates: the machine's aggregate rate split evenly. A single rank's rate is not a ceiling
then: in any window the scheduler may give one rank a whole core while another waits, so
individual readings scatter above and below the fair share, while their sum stays at what
the cores can do.

**A ceiling, not a snapshot.** Other load on the machine can only make a reading low, and a
low peak makes every later MFU too high (one calibration taken while other processes kept
the cores busy read 30 GFLOP/s per rank where a quiet machine gives 83: every MFU after it
2.7× too high). So each cached value records *when* and *under what conditions* it was
measured (:class:`PeakReading`: the 1-minute load average, the cores other processes used
during the loop, threads, ranks, cores) and is measured again when

* it is older than ``max_age_s`` (:data:`PEAK_MAX_AGE_S`, one hour), or
* the machine is now quieter than any time it was measured or confirmed: the 1-minute load
  average is at least :data:`QUIETER_BY` runnable tasks below (both readings include the
  job's own ranks, taken at the same point of a job), or
* the caller asks (``refresh=True``: :func:`labkit.train.metrics.flops_and_mfu` does when a
  step's HFU exceeds 100 %, which no ceiling allows).

A new reading replaces a cached one that is expired (or has no record of its conditions) or
lower; a lower one leaves the higher value and only records that it was confirmed at the
new load. Results are cached in ``cache_path()`` by CPU model, threads, ranks, matrix size
and dtype.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

__all__ = ["calibrate_cpu_peak", "cpu_peak_reading", "PeakReading", "stale_reason",
           "cpu_model_name", "cache_path", "PEAK_MAX_AGE_S", "QUIETER_BY"]

#: a cached peak older than this (s) is measured again
PEAK_MAX_AGE_S = 3600.0
#: the 1-minute load average must be this many runnable tasks below the one a cached peak was
#: measured (or last confirmed) under for the machine to count as quieter
QUIETER_BY = 1.0


def _now() -> float:
    """Wall-clock seconds since the epoch (a function, so tests can inject a clock)."""
    return time.time()


def _loadavg() -> Optional[float]:
    """The 1-minute load average (runnable tasks), ``None`` where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def _busy_seconds() -> Optional[float]:
    """CPU-seconds all cores spent busy since boot, from ``/proc/stat`` (``None`` elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


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


@dataclass(frozen=True)
class PeakReading:
    """A CPU peak with its provenance.

    Attributes:
        flops: FLOP/s per rank.
        measured_at: when the value was measured (s since the epoch).
        conditions: ``{"loadavg_1m"`` (runnable tasks when the loop started), ``"other_cpus"``
            (cores other processes kept busy during the loop, ``None`` without
            ``/proc/stat``), ``"threads"``, ``"ranks"``, ``"cpus"``}.
        confirmed_load: the lowest load average under which a new measurement did not beat
            this value (the machine must be quieter than that to try again).
        source: ``"cached"`` or ``"measured: <why>"``.
    """

    flops: float
    measured_at: float
    conditions: dict = field(default_factory=dict)
    confirmed_load: Optional[float] = None
    source: str = "cached"

    def age_s(self, now: Optional[float] = None) -> float:
        """Seconds since :attr:`measured_at`."""
        return (_now() if now is None else now) - self.measured_at

    def to_entry(self) -> dict:
        return {"flops": self.flops, "measured_at": self.measured_at,
                "conditions": dict(self.conditions), "confirmed_load": self.confirmed_load}

    @classmethod
    def from_entry(cls, entry) -> Optional["PeakReading"]:
        """The reading of a cache entry, ``None`` for a missing or old-format (bare number)
        one, which records neither time nor conditions."""
        if not isinstance(entry, dict):
            return None
        try:
            return cls(float(entry["flops"]), float(entry["measured_at"]),
                       dict(entry.get("conditions") or {}), entry.get("confirmed_load"))
        except (KeyError, TypeError, ValueError):
            return None


def stale_reason(reading: Optional[PeakReading], now: float, load_now: Optional[float],
                 max_age_s: float = PEAK_MAX_AGE_S) -> Optional[str]:
    """Why a cached peak must be measured again, or ``None`` if it still stands.

    ``now`` in s since the epoch, ``load_now`` the 1-minute load average (``None``: unknown,
    never "quieter").
    """
    if reading is None or reading.flops <= 0:
        return "no cached value with its time and conditions"
    age = now - reading.measured_at
    if age > max_age_s:
        return f"old: measured {age:.0f} s ago (limit {max_age_s:.0f} s)"
    loads = [v for v in (reading.conditions.get("loadavg_1m"), reading.confirmed_load)
             if isinstance(v, (int, float))]
    if load_now is not None and loads and load_now <= min(loads) - QUIETER_BY:
        return f"machine quieter: load average {load_now:.2f} now vs {min(loads):.2f} then"
    return None


def _read_cache(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: Path, key: str, new: PeakReading, replace: bool) -> PeakReading:
    """Write ``new`` unless the cached value is higher and still valid (``replace`` false):
    then keep that value, recording the load it was confirmed under. Returns what stands."""
    old = PeakReading.from_entry(_read_cache(path).get(key))
    keep = new
    if old is not None and not replace and old.flops > new.flops:
        load = new.conditions.get("loadavg_1m")
        prev = old.confirmed_load if old.confirmed_load is not None else \
            old.conditions.get("loadavg_1m")
        lows = [v for v in (load, prev) if isinstance(v, (int, float))]
        keep = PeakReading(old.flops, old.measured_at, old.conditions,
                           min(lows) if lows else None, new.source)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = keep.to_entry()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent ranks never see half a file
    except OSError:
        pass  # a read-only home must not break a measurement
    return keep


def _measure(n: int, seconds: float, dtype: torch.dtype, ranks: int,
             barrier: Optional[Callable[[], object]]) -> tuple[float, Optional[float]]:
    """``(FLOP/s of this process's loop, cores other processes used meanwhile)``."""
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
    busy0, own0 = _busy_seconds(), time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        torch.mm(a, b, out=c)
        iters += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    wall = now - start
    busy1, own1 = _busy_seconds(), time.process_time()
    other = None
    if busy0 is not None and busy1 is not None:
        # the machine's busy cores less this job's ranks (each assumed to use what this did)
        other = max(0.0, (busy1 - busy0 - ranks * (own1 - own0)) / wall)
    return 2.0 * n ** 3 * iters / wall, other


def cpu_peak_reading(n: int = 512, seconds: float = 0.3,
                     barrier: Optional[Callable[[], object]] = None, cache: bool = True,
                     ranks: int = 1, dtype: torch.dtype = torch.float32,
                     refresh: bool = False,
                     combine: Optional[Callable[[float], float]] = None,
                     decide: Optional[Callable[[bool], bool]] = None,
                     max_age_s: float = PEAK_MAX_AGE_S) -> PeakReading:
    """The CPU peak (FLOP/s per rank) with when and under what conditions it was measured.

    Uses the cached value unless :func:`stale_reason` (age, a quieter machine) or
    ``refresh`` asks for a new measurement. Arguments as :func:`calibrate_cpu_peak`, plus
    ``decide(local) -> bool``: called on every rank with this rank's wish to measure, returns
    the group's decision (any rank) so that all ranks measure together or none does.

    Raises:
        ValueError: if ``n < 1``, ``seconds <= 0`` or ``max_age_s < 0``.
    """
    if n < 1 or seconds <= 0 or max_age_s < 0:
        raise ValueError(f"need n >= 1, seconds > 0 and max_age_s >= 0, got n={n}, "
                         f"seconds={seconds}, max_age_s={max_age_s}")
    threads = torch.get_num_threads()
    key = (f"{cpu_model_name()}|threads={threads}|ranks={ranks}|n={n}"
           f"|dtype={str(dtype).removeprefix('torch.')}" + ("|mean" if combine else ""))
    path = cache_path()
    now, load = _now(), _loadavg()
    old = PeakReading.from_entry(_read_cache(path).get(key)) if cache else None
    why = "asked" if refresh or not cache else stale_reason(old, now, load, max_age_s)
    wish = why is not None
    if decide is not None:
        go = bool(decide(wish))
        why = why or ("another rank asked" if go else None)
    if why is None:
        return old
    flops, other = _measure(n, seconds, dtype, ranks, barrier)
    if combine is not None:
        flops = combine(flops)
        other = combine(-1.0 if other is None else other)  # every rank calls combine twice
        other = None if other < 0 else other
    new = PeakReading(flops, now, {"loadavg_1m": load, "other_cpus": other, "threads": threads,
                                   "ranks": ranks, "cpus": os.cpu_count()},
                      None, f"measured: {why}")
    if not cache:
        return new
    replace = old is None or stale_reason(old, now, None, max_age_s) is not None
    return _store(path, key, new, replace)


def calibrate_cpu_peak(n: int = 512, seconds: float = 0.3,
                       barrier: Optional[Callable[[], object]] = None, cache: bool = True,
                       ranks: int = 1, dtype: torch.dtype = torch.float32,
                       refresh: bool = False,
                       combine: Optional[Callable[[float], float]] = None,
                       max_age_s: float = PEAK_MAX_AGE_S) -> float:
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
            ``n`` and ``dtype``; a cached value that still stands (see the module's
            docstring) returns at once without calling ``barrier``.
        ranks: how many ranks run the loop concurrently (part of the cache key).
        refresh: measure even when cached; the cache keeps the larger of the two values
            unless the cached one has expired.
        combine: called on every rank with its measured rate (and then with the cores other
            processes used); returns the value to cache and return (e.g. the mean over the
            ranks, as :func:`labkit.measure.rank_peak.rank_peak_flops` does).
        max_age_s: a cached value older than this is measured again.

    Returns:
        FLOP/s (float). :func:`cpu_peak_reading` returns it with its time and conditions.

    Raises:
        ValueError: if ``n < 1``, ``seconds <= 0`` or ``max_age_s < 0``.
    """
    return cpu_peak_reading(n, seconds, barrier, cache, ranks, dtype, refresh, combine,
                            max_age_s=max_age_s).flops
