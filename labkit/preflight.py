"""Checks made before any rank process starts: how many ranks the machine can hold, where
output files go, and whether the model state fits in memory.

Each raises ``ValueError`` naming the field and the numbers, so a notebook cell or the CLI
reports the mistake at once instead of after spawning, training or exhausting memory.
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["MAX_RANKS_PER_CORE", "cpu_cores", "machine_memory_bytes", "check_world_size",
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
    """Physical memory in bytes, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


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


def check_model_state_fits(total_bytes: float, what: str, fraction: float = 0.8) -> None:
    """Refuse a run whose model state alone (parameters, gradients, optimizer, summed over
    the ranks on this machine) exceeds ``fraction`` of physical memory.

    Raises:
        ValueError: naming both sizes in GB.
    """
    mem = machine_memory_bytes()
    if mem and total_bytes > fraction * mem:
        raise ValueError(f"{what} needs {total_bytes / 1e9:.1f} GB of model state across its "
                         f"ranks, more than {fraction:.0%} of this machine's "
                         f"{mem / 1e9:.1f} GB; use a smaller model or fewer ranks")


def check_run_fits(cfg) -> None:
    """A validated Run/Zero/PipelineConfig fits this machine: its rank count, and its model
    state (fp32 AdamW, 16 bytes per parameter, sharded by the ZeRO stage) summed over the
    ranks within physical memory. Activations come on top and are not counted.

    Raises:
        ValueError: from :func:`check_world_size` or :func:`check_model_state_fits`.
    """
    from .models.gpt import count_params
    from .plan.memory import model_state_bytes

    run = getattr(cfg, "run", cfg)  # a ZeroConfig wraps its RunConfig
    if hasattr(cfg, "schedule"):  # pipeline: the stages hold one model between them
        ranks, field, total = cfg.pp, "pp", 16.0 * count_params(cfg.model_config)
    else:
        ranks, field = run.parallel.world_size, "dp"
        per_rank = model_state_bytes(count_params(run.model_config), run.parallel.dp,
                                     getattr(cfg, "zero_stage", 0), mixed_precision=False)
        total = ranks * per_rank["total"]
    check_world_size(ranks, field)
    check_model_state_fits(total, f"model {getattr(cfg, 'model', run.model)!r} on {ranks} "
                                  f"rank(s)")
