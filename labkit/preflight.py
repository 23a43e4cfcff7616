"""Checks made before any rank process starts: how many ranks the machine can hold, where
output files go, and whether the model state fits in memory.

Each raises ``ValueError`` naming the field and the numbers, so a notebook cell or the CLI
reports the mistake at once instead of after spawning, training or exhausting memory.
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["MAX_RANKS_PER_CORE", "PROCESS_BYTES", "cpu_cores", "machine_memory_bytes", "check_world_size",
           "check_output_path", "check_model_state_fits", "check_run_fits"]

#: ranks beyond this many per core only time the operating system's sharing of the cores
MAX_RANKS_PER_CORE = 8


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine_memory_bytes() -> Optional[int]:
    """Memory available to new processes now, in bytes (``MemAvailable`` from
    ``/proc/meminfo``; physical memory where that is missing), or ``None``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


#: a rank process's own footprint before any model (Python, torch, gloo), bytes
PROCESS_BYTES = 350e6


def check_world_size(n: int, field: str = "world_size") -> None:
    """Refuse more CPU rank processes than ``MAX_RANKS_PER_CORE`` per core.

    Raises:
        ValueError: e.g. ``pp=64 would start 64 rank processes on 2 CPU cores ...``.
    """
    cores = cpu_cores()
    limit = MAX_RANKS_PER_CORE * cores
    if n > limit:
        raise ValueError(f"{field}={n} would start {n} rank processes on {cores} CPU cores; "
                         f"at most {MAX_RANKS_PER_CORE} per core ({limit}) run here, since "
                         "more would only time the sharing of the cores")


def check_output_path(path: Optional[str], flag: str) -> None:
    """Refuse an output file whose folder does not exist, or that names a folder.

    Raises:
        ValueError: naming ``flag`` and the path.
    """
    if not path:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: that is a folder; give a file name inside it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")


def check_model_state_fits(total_bytes: float, what: str, fraction: float = 0.9) -> None:
    """Refuse a run whose estimated resident bytes (summed over the ranks on this machine)
    exceed ``fraction`` of the memory available now.

    Raises:
        ValueError: naming both sizes in GB.
    """
    mem = machine_memory_bytes()
    if mem and total_bytes > fraction * mem:
        raise ValueError(f"{what} needs about {total_bytes / 1e9:.1f} GB before activations, "
                         f"more than {fraction:.0%} of the {mem / 1e9:.1f} GB this machine has "
                         "available; use a smaller model or fewer ranks")


def check_run_fits(cfg) -> None:
    """A validated Run/Zero/PipelineConfig fits this machine: its rank count, and per rank
    the larger of its model state (fp32 AdamW, 16 bytes per parameter, sharded by the ZeRO
    stage or split over pipeline stages) and the whole fp32 model it builds first, plus
    ``PROCESS_BYTES``, summed over the ranks within the memory available now. Activations
    come on top and are not counted, so this refuses only what cannot fit.

    Raises:
        ValueError: from :func:`check_world_size` or :func:`check_model_state_fits`.
    """
    from .models.gpt import count_params
    from .plan.memory import model_state_bytes

    run = getattr(cfg, "run", cfg)  # a ZeroConfig wraps its RunConfig
    mc = cfg.model_config if hasattr(cfg, "schedule") else run.model_config
    psi = count_params(mc)
    full = 4.0 * psi  # every rank builds the whole fp32 model before sharding or cutting it
    if hasattr(cfg, "schedule"):  # pipeline: the stages share one model's state
        ranks, field = cfg.pp, "pp"
        per_rank = full + 16.0 * psi / ranks
    else:
        ranks, field = run.parallel.world_size, "dp"
        per_rank = max(full, model_state_bytes(psi, run.parallel.dp,
                                               getattr(cfg, "zero_stage", 0),
                                               mixed_precision=False)["total"])
    check_world_size(ranks, field)
    check_model_state_fits(ranks * (per_rank + PROCESS_BYTES),
                           f"model {mc.name or 'custom'} ({mc.n_layers} layers, "
                           f"{psi / 1e6:,.1f}M parameters) on {ranks} rank(s)")
