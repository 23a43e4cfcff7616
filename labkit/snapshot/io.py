"""Save and load on the ranks: every rank writes its own file, reads what its new boxes
overlap, and reports bytes, seconds and files.

Both run outside the traced step (the tracer is paused): DCP's planning collectives and the
ZeRO re-gather after a load are bookkeeping, not the step's traffic. DCP exchanges its plans
with torch.distributed's object collectives over the job's group itself (the one place
labkit lets a library call them: they carry plans, not tensors of the run); what moves the
state is the file system, measured here as bytes per rank and file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from .. import comm
from . import folder
from .pieces import LoadPlanner, SavePlanner
from .state import after_load, init_optimizer_state, reads, rng_key, slots, state_dict

__all__ = ["save", "load", "layout"]


def layout(cfg, world: int) -> dict:
    """What decides where each shard lives; equal layouts reload bit for bit."""
    return {"world": world, "parallel": dataclasses.asdict(cfg.parallel),
            "zero_stage": cfg.zero_stage, "hsdp_replicas": cfg.hsdp_replicas,
            "schedule": cfg.schedule if cfg.parallel.pp > 1 else None,
            "virtual_stages": cfg.stages_per_rank if cfg.parallel.pp > 1 else None,
            "impl": cfg.impl}


@contextlib.contextmanager
def _untraced(ctx):
    enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
    try:
        yield
    finally:
        ctx.tracer.enabled = enabled


def _agree(ctx, ok: bool) -> bool:
    """All ranks learn whether every rank is ``ok`` (a failed rank must not leave the others
    waiting inside DCP's collectives)."""
    t = torch.tensor([0.0 if ok else 1.0])
    if ctx.world_size > 1:
        comm.all_reduce(t, "sum", ctx.group)
    return t.item() == 0


def save(ctx, setup, step: int) -> dict:
    """Write the state after ``step`` steps to ``cfg.save_dir/step_NNNNNN`` (collective).

    Returns this rank's ``{"step", "dir", "file", "bytes_written", "seconds"}`` (bytes: the
    size of this rank's ``.distcp`` file; replicated chunks are written by one rank only).

    Raises:
        ValueError: another live run holds the folder's lock (on every rank).
    """
    cfg = setup.cfg
    t0 = time.perf_counter()
    save_dir = Path(cfg.save_dir)
    partial, final = folder.partial_dir(save_dir, step), folder.step_dir(save_dir, step)
    err = None
    with _untraced(ctx):
        if ctx.rank == 0:
            try:
                save_dir.mkdir(parents=True, exist_ok=True)
                folder.take_lock(save_dir, step)
                shutil.rmtree(partial, ignore_errors=True)  # a crashed writer's leftovers
                partial.mkdir()
            except (OSError, ValueError) as e:
                err = e
        try:
            if not _agree(ctx, err is None):
                raise err if err is not None else ValueError(
                    f"save_dir={str(save_dir)!r}: rank 0 could not start the snapshot "
                    "(see rank 0)")
            mine, size = _write(ctx, setup, step, partial, final)
        finally:
            # a failed save leaves its .partial folder (never read) but not its lock, so the
            # next run may write here (another run's lock is not ours to remove)
            if ctx.rank == 0:
                folder.release_lock(save_dir)
    return {"step": step, "dir": str(final), "file": mine if size else None,
            "bytes_written": size, "seconds": time.perf_counter() - t0}


def _write(ctx, setup, step: int, partial: Path, final: Path) -> tuple:
    """DCP writes every rank's file into ``partial``; rank 0 adds the manifest and renames
    it to ``final``. Returns this rank's ``(file name, bytes)``."""
    cfg = setup.cfg
    sd, _ = state_dict(setup, slots(setup), ctx.rank, ctx.world_size, for_load=False)
    writer = dcp.FileSystemWriter(str(partial))
    dcp.save(sd, storage_writer=writer, planner=SavePlanner(), process_group=ctx.group)
    mine = f"__{ctx.rank}_0.distcp"
    size = (partial / mine).stat().st_size if (partial / mine).exists() else 0
    comm.barrier(ctx.group)  # every file is complete before rank 0 renames the folder
    if ctx.rank == 0:
        files = {f.name: f.stat().st_size for f in partial.iterdir()
                 if f.name.endswith(".distcp")}
        info = {**folder.model_fields(cfg), "step": step, "layout": layout(cfg, ctx.world_size),
                "token_groups": folder.token_groups(cfg), "files": files, "config": repr(cfg),
                "time": time.time()}
        (partial / folder.MANIFEST).write_text(json.dumps(info, indent=1))
        folder.fsync_dir(partial)
        folder.publish(partial, final)
        folder.fsync_dir(partial.parent)
    comm.barrier(ctx.group)
    return mine, size


def load(ctx, setup, snap) -> tuple:
    """Load the snapshot folder ``snap`` into this rank's composition, in place (collective).

    Returns ``(step, report)``: the steps already trained, and this rank's ``{"dir", "step",
    "saved_layout", "same_layout", "bytes_read", "reads": {file: bytes}, "elements_needed",
    "objective_change", "seconds"}``. In the layout it was saved in, the RNG state is restored
    too. ``objective_change`` says why a mixture-of-experts run resumed with other token
    groups trains another objective (:func:`labkit.snapshot.folder.objective_change`), else
    ``None``.

    Raises:
        ValueError: the manifest or a shard file is wrong (see
            :func:`labkit.snapshot.folder.check_resume`), or it lacks a tensor this
            composition needs (naming ``.metadata`` and the key).
    """
    cfg = setup.cfg
    t0 = time.perf_counter()
    snap = Path(snap)
    info = folder.read_info(snap)
    folder.check_files(snap, info)
    same = info.get("layout") == layout(cfg, ctx.world_size)
    with _untraced(ctx):
        init_optimizer_state(setup.opt)
        sd, steps = state_dict(setup, slots(setup), ctx.rank, ctx.world_size, for_load=True)
        reader = dcp.FileSystemReader(str(snap))
        md = reader.read_metadata()
        key = rng_key(ctx.rank, ctx.world_size)
        if not same or key not in md.state_dict_metadata:
            sd.pop(key)
            same = False
        missing = [k for k in sd if k not in md.state_dict_metadata]
        if not _agree(ctx, not missing):
            raise ValueError(f"{snap / '.metadata'}: no entry {missing[0]!r} that this "
                             f"composition needs ({len(missing)} missing)" if missing else
                             f"{snap}: another rank found the checkpoint incomplete")
        planner = LoadPlanner()
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=ctx.group)
        after_load(setup, sd, steps, ctx.rank, ctx.world_size, same)
    r = reads(planner, reader)
    return info["step"], {"dir": str(snap), "step": info["step"],
                          "saved_layout": info.get("layout"), "same_layout": same,
                          "bytes_read": sum(r["files"].values()), "reads": r["files"],
                          "elements_needed": r["elements_needed"],
                          "objective_change": folder.objective_change(cfg, info, snap),
                          "seconds": time.perf_counter() - t0}
