"""Checks made before any rank process starts: how many ranks the machine can hold, where
output files go, and whether the model state fits in memory.

Each raises :class:`~labkit.validate.ConfigError` (a ``ValueError``) naming the field and
the numbers, so a notebook cell or the CLI reports the mistake at once instead of after
spawning, training or exhausting memory; in a notebook the sentence shows alone, without
preflight's frames.
"""
from __future__ import annotations

import os
from typing import Optional

from .validate import ConfigError

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


def check_world_size(n: int, field: str = "world_size", shown: Optional[str] = None) -> None:
    """Refuse more CPU rank processes than ``MAX_RANKS_PER_CORE`` per core. ``shown``
    replaces ``field=n`` in the message (e.g. ``dp x pp = 2 x 32 = 64``).

    Raises:
        ConfigError: e.g. ``pp=64 would start 64 rank processes on 2 CPU cores ...``.
    """
    cores = cpu_cores()
    limit = MAX_RANKS_PER_CORE * cores
    if n > limit:
        raise ConfigError(f"{shown or f'{field}={n}'} would start {n} rank processes on "
                         f"{cores} CPU cores; "
                         f"at most {MAX_RANKS_PER_CORE} per core ({limit}) run here, since "
                         "more would only time the sharing of the cores")


def check_output_path(path: Optional[str], flag: str) -> None:
    """Refuse an output file whose folder does not exist, or that names a folder.

    Raises:
        ConfigError: naming ``flag`` and the path.
    """
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: that is a folder; give a file name inside it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist")


def check_model_state_fits(total_bytes: float, what: str, fraction: float = 0.9) -> None:
    """Refuse a run whose estimated resident bytes (summed over the ranks on this machine)
    exceed ``fraction`` of the memory available now.

    Raises:
        ConfigError: naming both sizes in GB.
    """
    mem = machine_memory_bytes()
    if mem and total_bytes > fraction * mem:
        raise ConfigError(f"{what} needs about {total_bytes / 1e9:.1f} GB before activations, "
                         f"more than {fraction:.0%} of the {mem / 1e9:.1f} GB this machine has "
                         "available; use a smaller model or fewer ranks")


def check_run_fits(cfg) -> None:
    """A validated :class:`~labkit.config.RunConfig` fits this machine: its ``cfg.mesh.size``
    rank processes, and their memory summed within what is available now.

    Per rank: the larger of the whole fp32 model every rank builds first (4 bytes per
    parameter, before it keeps its pipeline stages and shards them) and its model state
    once placed on the mesh — the pipeline stages (and tensor-parallel ranks) share the
    model, ``Ψ / (pp · tp)`` parameters each, and ZeRO shards their state over the
    ``dp_shard × cp`` shard group by its stage (:func:`labkit.plan.model_state_bytes`:
    fp32 AdamW 4/4/8 bytes per parameter, bf16 with ZeRO 2/2/12) — plus
    ``PROCESS_BYTES``. Activations come on top and are not counted, so this refuses only
    what cannot fit.

    Raises:
        ConfigError: from :func:`check_world_size` (naming the degrees) or
            :func:`check_model_state_fits`.
    """
    mesh, mc, p = cfg.mesh, cfg.model_config, cfg.parallel
    ranks = mesh.size
    used = [(k, getattr(p, k)) for k in ("dp", "tp", "pp", "cp") if getattr(p, k) > 1]
    if len(used) > 1:
        shown = (f"{' x '.join(k for k, _ in used)} = {' x '.join(str(v) for _, v in used)}"
                 f" = {ranks}")
        check_world_size(ranks, shown=shown)
    else:
        check_world_size(ranks, used[0][0] if used else "world_size")
    from .models.gpt import count_params  # torch: only once the rank count is fine
    from .plan.memory import model_state_bytes

    psi = count_params(mc)
    share = psi / (mesh.pp * mesh.tp)
    stage, bf16 = cfg.zero_stage, cfg.precision == "bf16"
    state = model_state_bytes(share, mesh.degree("fsdp") if stage else 1, stage,
                              mixed_precision=bf16 and stage > 0)["total"]
    per_rank = max(4.0 * psi, state)
    check_model_state_fits(ranks * (per_rank + PROCESS_BYTES),
                           f"model {mc.name or 'custom'} ({mc.n_layers} layers, "
                           f"{psi / 1e6:,.1f}M parameters) on {ranks} rank(s)")
