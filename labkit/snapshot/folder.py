"""The save folder: complete snapshots, the one being written, and what is checked before
a run resumes from one.

::

    save_dir/
      step_000002/            a complete snapshot (renamed into place when complete)
        .metadata             DCP's manifest: every tensor's global shape, its chunks, and
                              which file, offset and length holds each chunk
        __0_0.distcp …        one file per rank of the saving run (that rank's shards)
        labkit.json           the run's config, the step, the layout, bytes per file
      .partial-step_000004/   being written (never read)
      .in-progress            lock: which process is writing (pid, host, step)

A snapshot is written into ``.partial-step_N`` and renamed to ``step_N`` only after every
rank's file and the manifest are on disk, so a crash mid-write leaves the previous
snapshot as the latest complete one (the write-then-rename rule). Everything here is pure
file handling and runs in the caller before launch as well as on the ranks.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional, Union

__all__ = ["step_dir", "partial_dir", "LOCK", "MANIFEST", "latest", "resolve", "read_info",
           "check_lock", "take_lock", "release_lock", "check_resume", "check_files",
           "token_groups", "objective_change", "ObjectiveChangeWarning",
           "model_fields", "publish", "fsync_dir"]

LOCK = ".in-progress"
MANIFEST = "labkit.json"
_PREFIX = "step_"


def step_dir(save_dir, step: int) -> Path:
    return Path(save_dir) / f"{_PREFIX}{step:06d}"


def partial_dir(save_dir, step: int) -> Path:
    return Path(save_dir) / f".partial-{_PREFIX}{step:06d}"


def _complete(d: Path) -> bool:
    return (d / MANIFEST).is_file() and (d / ".metadata").is_file()


def latest(save_dir) -> Optional[Path]:
    """The complete snapshot of the highest step under ``save_dir`` (``None``: none)."""
    d = Path(save_dir)
    if not d.is_dir():
        return None
    done = [p for p in d.iterdir() if p.name.startswith(_PREFIX) and p.is_dir() and _complete(p)]
    return max(done, key=lambda p: p.name) if done else None


def resolve(cfg) -> Path:
    """The snapshot ``cfg.resume`` names: ``True`` → the latest complete one under
    ``cfg.save_dir``; a path → that snapshot, or the latest under it if it is a save folder.

    Raises:
        ValueError: nothing complete to resume from (naming the folder and, when another
            run is writing there, its lock file).
    """
    where = Path(cfg.save_dir if cfg.resume is True else cfg.resume)
    if _complete(where):
        return where
    found = latest(where)
    if found is not None:
        return found
    lock = where / LOCK
    if lock.exists() or any(p.name.startswith(".partial-") for p in where.glob(".partial-*")):
        raise ValueError(f"resume={cfg.resume!r}: {where} has no complete snapshot, only one "
                         f"being written ({_describe_lock(lock)}); wait for it to finish")
    raise ValueError(f"resume={cfg.resume!r}: no complete snapshot in {where} (expected a "
                     f"{_PREFIX}NNNNNN folder with {MANIFEST} and .metadata)")


def read_info(snap: Path) -> dict:
    """``labkit.json`` of a snapshot, parsed. Raises ``ValueError`` naming the file."""
    f = Path(snap) / MANIFEST
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: unreadable snapshot manifest ({e})") from None


def model_fields(cfg) -> dict:
    """What must be equal for a snapshot to load: the model's shape and the data stream
    (the seed and dataset pick every batch; the step picks the position in it)."""
    return {"model": dataclasses.asdict(cfg.model_config), "seed": cfg.seed,
            "dataset": cfg.dataset}


class ObjectiveChangeWarning(UserWarning):
    """A mixture-of-experts run resumed with other token groups than it was saved with: it
    continues from the same state but trains another objective (:func:`objective_change`)."""


def token_groups(cfg) -> Optional[dict]:
    """How a mixture-of-experts run splits each step's tokens into the groups its
    load-balancing loss and expert capacity are computed over: one forward's tokens, i.e.
    one (data rank, microbatch, context rank) — the rule tests/oracle/run.py writes out
    independently. ``None`` for a dense model, whose objective no layout changes. Tensor,
    pipeline (beyond its microbatches), expert and ZeRO degrees do not enter: their tokens
    are one forward's."""
    if not cfg.model_config.n_experts:
        return None
    p = cfg.parallel
    return {"dp": p.dp, "micro_batch": cfg.micro, "cp": p.cp,
            "cp_zigzag": bool(cfg.cp_zigzag) if p.cp > 1 else False,
            "global_batch": cfg.global_batch,
            "groups_per_step": cfg.global_batch // cfg.micro * p.cp}


def _groups_text(g: dict) -> str:
    return (f"dp={g['dp']}, micro_batch={g['micro_batch']}, cp={g['cp']}"
            f"{' zigzag' if g['cp_zigzag'] else ''}: {g['groups_per_step']} groups per step")


def objective_change(cfg, info: dict, snap: Optional[Path] = None) -> Optional[str]:
    """Why a resumed mixture-of-experts run cannot reproduce the uninterrupted run, in
    words, or ``None`` when its objective is the saved run's (a dense model; the same token
    groups). The parameters, AdamW moments and steps load exactly either way; what changes
    is the load-balancing loss and capacity, computed per token group (Fedus et al. 2022,
    §2.2: per batch of tokens a router sees), so the gradients of every later step differ."""
    mine, theirs = token_groups(cfg), info.get("token_groups")
    if mine is None or theirs is None or mine == theirs:
        return None
    where = f"{snap / MANIFEST}: " if snap is not None else ""
    return (f"{where}this mixture-of-experts run splits each step's tokens into other groups "
            f"than the run that saved it ({_groups_text(theirs)} -> {_groups_text(mine)}); "
            f"the load-balancing loss and expert capacity are computed per group, so from "
            f"step {info.get('step')} on it trains another objective and will not reproduce "
            f"the uninterrupted run's losses. Parameters, AdamW moments and steps load "
            f"exactly; keep dp, micro_batch, cp and global_batch as saved to continue the "
            f"same objective")


def check_resume(cfg) -> Path:
    """Everything about ``cfg.resume`` that can be checked from files, before launch: the
    snapshot exists and is complete, it is of this model and data stream, and every shard
    file the manifest names is there at full length. Returns the snapshot folder.

    Raises:
        ValueError: naming the file and the field (a checkpoint of another model: the first
            differing model field with both values; a missing or truncated shard: the file,
            its expected and actual bytes).
    """
    snap = resolve(cfg)
    info = read_info(snap)
    want = model_fields(cfg)
    for key, mine in want.items():
        theirs = info.get(key)
        if key == "model" and isinstance(theirs, dict):
            for k, v in mine.items():
                if theirs.get(k) != v:
                    raise ValueError(f"{snap / MANIFEST}: model.{k}={theirs.get(k)!r} in the "
                                     f"checkpoint but {v!r} in this run: a checkpoint of "
                                     "another model cannot be loaded")
        elif theirs != mine:
            raise ValueError(f"{snap / MANIFEST}: {key}={theirs!r} in the checkpoint but "
                             f"{mine!r} in this run")
    if cfg.steps <= info["step"]:
        raise ValueError(f"steps={cfg.steps} but {snap} was saved after step {info['step']}: "
                         "nothing left to train (steps counts from the run's start)")
    check_files(snap, info)
    return snap


def check_files(snap: Path, info: dict) -> None:
    """Every rank file the manifest lists exists with its recorded size.

    Raises:
        ValueError: naming the missing or truncated file and both sizes.
    """
    for name, size in info.get("files", {}).items():
        f = Path(snap) / name
        if not f.is_file():
            raise ValueError(f"{f}: shard file missing (labkit.json lists {size} bytes)")
        have = f.stat().st_size
        if have != size:
            raise ValueError(f"{f}: truncated shard: {have} bytes, labkit.json says {size}")


# -- the lock --------------------------------------------------------------------------
def _describe_lock(lock: Path) -> str:
    try:
        d = json.loads(lock.read_text())
        return (f"{lock}: pid {d.get('pid')} on {d.get('host')} writing step "
                f"{d.get('step')} since {time.strftime('%H:%M:%S', time.localtime(d.get('t', 0)))}")
    except (OSError, ValueError):
        return f"{lock}"


def _alive(d: dict) -> bool:
    if d.get("host") != socket.gethostname():
        return True  # cannot tell: assume it is
    try:
        os.kill(int(d.get("pid", -1)), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def check_lock(save_dir, field: str = "save_dir") -> None:
    """Refuse a folder another live process is writing a snapshot into. A lock left by a
    process that no longer exists (on this host) is stale and ignored.

    Raises:
        ValueError: naming the lock file, its pid, host and step.
    """
    lock = Path(save_dir) / LOCK
    try:
        d = json.loads(lock.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        d = {}
    if d.get("pid") == os.getpid() and d.get("host") == socket.gethostname():
        return
    if _alive(d):
        raise ValueError(f"{field}={str(save_dir)!r} is being written by another run "
                         f"({_describe_lock(lock)})")


def take_lock(save_dir, step: int) -> Path:
    """Write the lock (this process, this step) atomically. Raises like :func:`check_lock`."""
    check_lock(save_dir)
    lock = Path(save_dir) / LOCK
    tmp = lock.with_name(f"{LOCK}.{os.getpid()}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "step": step, "t": time.time()}))
    os.replace(tmp, lock)
    return lock


def release_lock(save_dir) -> None:
    lock = Path(save_dir) / LOCK
    try:
        d = json.loads(lock.read_text())
    except (OSError, ValueError):
        return
    if d.get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


def publish(partial: Path, final: Path) -> None:
    """Rename the finished ``partial`` into ``final``. An older snapshot of the same step is
    moved aside first and deleted only after the new one is in place."""
    import shutil

    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(partial, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(d: Union[str, Path]) -> None:
    """Flush a folder's entries (a rename, new files) to disk where the OS allows it."""
    try:
        fd = os.open(str(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
