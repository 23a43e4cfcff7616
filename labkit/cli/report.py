"""What ``labkit run`` prints for one :class:`~labkit.config.RunConfig` run: tables or JSON.

Every composition prints the same sections, from :func:`labkit.train.run`'s per-rank
metrics (both launchers, own cluster and torchrun, print through :func:`report`):

* a header: model, degrees and knobs, batch split, then ``cfg.mesh.describe()``;
* **memory per rank** by category, model state measured beside :mod:`labkit.plan`'s
  prediction for the rank's stages, ZeRO stage and shard count, with step time and MFU/HFU;
* **bytes per rank per step by mesh axis and collective**, as ``labkit.comm`` counted them
  beside the prediction, the lecture's data-parallel formula (2Ψ / 3Ψ · (N−1)/N · B) and,
  at ZeRO-3, the fraction of all-gather time hidden under compute ("—" when nothing is
  all-gathered, e.g. HSDP with one shard per group);
* with ``pp > 1`` the bubble section (:mod:`.pipeline`);
* the global loss per step and the wall time.

Sizes in MiB, bytes in B. ``rich`` is imported on use.
"""
from __future__ import annotations

import dataclasses
import json

from .fmt import DASH, MiB, make_console, mib, pair, pct

__all__ = ["report", "render", "run_json", "ag_hidden"]

AXIS_ORDER = ("dp", "pp", "tp", "cp", "ep", "world")
OP_ORDER = ("all_reduce", "reduce_scatter", "all_gather", "send", "recv", "broadcast",
            "all_to_all")
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MEMORY_TITLE = ("per rank: step time (median of the steady steps), MFU/HFU, memory in MiB "
                "measured / predicted: model state (the largest over "
                "the tracked step / labkit.plan for the rank's stages, ZeRO stage and shard "
                "count); activations, other and total at the peak")
COMM_TITLE = ("bytes each rank sends per step by mesh axis and collective, counted by "
              "labkit.comm (the algorithm's bytes; by formula for native collectives) / "
              "predicted")


def report(cfg, outputs: list, info: dict, as_json: bool = False, trace=None) -> None:
    """Print a finished run as tables or (``as_json``) one JSON object. ``outputs`` are the
    ranks' return values; a pipeline run (``pp > 1``) needs the merged ``trace``."""
    pipe = None
    if cfg.parallel.pp > 1:
        from ..parallel.pipeline.report import pipeline_report

        pipe = pipeline_report(cfg, [o["metrics"] for o in outputs], trace)
    if as_json:
        print(json.dumps(run_json(cfg, outputs, info, pipe), default=str))
    else:
        render(cfg, outputs, info, pipe)


def run_json(cfg, outputs: list, info: dict, pipe: dict = None) -> dict:
    """Plain data: the config (``dataclasses.asdict``), the mesh, the global loss per step,
    each rank's losses and metrics, and with a pipeline its ``summary`` and ``rows``."""
    m0 = outputs[0]["metrics"]
    out = {"model": m0["model"], "n_params": m0["n_params"], "world_size": len(outputs),
           **info, "mesh": cfg.mesh.describe(), "config": dataclasses.asdict(cfg),
           "losses": outputs[0]["losses"],
           "ranks": [{"rank": r, "losses": o["losses"], "metrics": o["metrics"]}
                     for r, o in enumerate(outputs)]}
    if pipe is not None:
        out["pipeline"] = {"summary": pipe["summary"], "rows": pipe["rows"]}
    return out


def ag_hidden(metrics: dict):
    """Fraction of this rank's ZeRO-3 all-gather time hidden under compute, or ``None``
    when it all-gathered no bytes on a data-parallel axis (one shard per group: the spans
    are empty calls; a tensor-parallel all-gather is not a ZeRO one,
    :func:`labkit.train.overlap.overlap_fraction`)."""
    from ..train.overlap import DP_AXES

    gathered = sum(ops.get("all_gather", 0.0)
                   for axis, ops in (metrics.get("comm_bytes_by_axis") or {}).items()
                   if axis in DP_AXES)
    hidden = (metrics.get("overlap") or {}).get("total")
    return hidden if gathered > 0 else None


def render(cfg, outputs: list, info: dict, pipe: dict = None, console=None) -> None:
    """Print the header, the mesh, memory and bytes per rank, the bubble (with ``pipe``,
    :func:`~labkit.parallel.pipeline.report.pipeline_report`'s answer) and the loss."""
    console = console or make_console()
    metrics = [o["metrics"] for o in outputs]
    _header(console, cfg, metrics[0], len(outputs), info)
    console.print(cfg.mesh.describe())
    console.print(MEMORY_TITLE)
    if any(m.get("step_time_warmup") for m in metrics):
        console.print("warning: only the first (warm-up) step was timed, so the step time and "
                      "MFU are not a steady step's; run 3 or more steps (--steps)")
    console.print(_memory_table(cfg, metrics))
    console.print(COMM_TITLE)
    console.print(_comm_table(cfg, metrics))
    for note in _comm_notes(cfg, metrics):
        console.print(f"note: {note}")
    if pipe is not None:
        from .pipeline import render_bubble

        render_bubble(console, cfg, pipe, info)
    for f in info.get("faults", []):
        detect = "—" if f["detect_s"] is None else f"{f['detect_s']:.2f} s"
        console.print(f"fault: {f['kind']} rank {f['rank']} at step {f['step']} · detected "
                      f"after {detect} · recovered in {f['recovery_s']:.1f} s · lost "
                      f"{f['lost_steps']} step(s), {f['lost_s']:.2f} s of work")
    if info.get("stragglers"):
        console.print(info["stragglers"])
    for text in info.get("silent_data_corruption", []):
        console.print(f"silent data corruption caught: {text}")
    losses = outputs[0]["losses"]
    tail = f" · trace → {info['trace']}" if info.get("trace") else ""
    first = metrics[0].get("first_step", 0)
    since = f" (steps {first}–{first + len(losses) - 1}, resumed)" if first else ""
    console.print(f"loss (global batch) {losses[0]:.4f} → {losses[-1]:.4f} over "
                  f"{len(losses)} step(s){since} · wall {info.get('wall_s', 0.0):.1f} s{tail}")
    for line in snapshot_lines(metrics):
        console.print(line)


def snapshot_lines(metrics: list) -> list:
    """One line per snapshot saved or loaded (:mod:`labkit.snapshot`): where, the bytes
    over all ranks, the slowest rank's seconds."""
    out = []
    snaps = [m.get("snapshot", {}) for m in metrics]
    loaded = [s["loaded"] for s in snaps if s.get("loaded")]
    if loaded:
        x = loaded[0]
        out.append(f"resumed from {x['dir']} after step {x['step']} "
                   f"({'same layout' if x['same_layout'] else 'resharded'}): read "
                   f"{sum(v['bytes_read'] for v in loaded):,} bytes over {len(loaded)} ranks, "
                   f"slowest {max(v['seconds'] for v in loaded):.2f} s")
    per_save = zip(*[s.get("saved", []) for s in snaps]) if all(s.get("saved") for s in snaps) \
        else []
    for saves in per_save:
        out.append(f"saved step {saves[0]['step']} → {saves[0]['dir']}: "
                   f"{sum(v['bytes_written'] for v in saves):,} bytes from {len(saves)} ranks, "
                   f"slowest {max(v['seconds'] for v in saves):.2f} s")
    return out


def _header(console, cfg, m0: dict, world: int, info: dict) -> None:
    from ..config import PRESETS

    mc, p, z = cfg.model_config, cfg.parallel, cfg.zero_stage
    layers = f"{mc.n_layers} layers"
    base = PRESETS.get(mc.name)
    deep = info.get("deepened")
    if deep:
        layers += (f" (preset {mc.name!r} has {deep['from']}; deepened to pp x V = "
                   f"{deep['to']}, one layer per stage)")
    elif base is not None and base.n_layers != mc.n_layers:
        layers += f" (preset {mc.name!r} has {base.n_layers}; --n-layers {mc.n_layers})"
    console.print(f"labkit run · model {mc.name} · {layers} · {m0['n_params']:,} params · "
                  f"world {world} · backend {info.get('backend', '?')} · launcher "
                  f"{info.get('launcher', '?')}")
    nodes = info.get("nodes")
    if nodes:
        sent = " · ".join(f"node {k} {v / 1e6:,.2f} MB"
                          for k, v in sorted(nodes["link_bytes"].items()))
        console.print(f"emulated nodes: {nodes['describe']} · sent across: {sent}")
    parts = [" · ".join(f"{k} {getattr(p, k)}" for k in ("dp", "tp", "pp", "cp", "ep")
                        if k in ("dp", "pp") or getattr(p, k) > 1)]
    mesh = cfg.mesh
    if z:
        zero = f"ZeRO-{z} · K={mesh.degree('fsdp')} shards × M={mesh.dp_replicate} replicas"
        if z == 3:
            zero += (f" · prefetch {'on' if cfg.prefetch else 'off'} · keep_last "
                     f"{'on' if cfg.keep_last else 'off'}")
        parts.append(zero)
    elif p.dp > 1:
        parts.append(f"dp_mode {cfg.dp_mode}" + (f" ({cfg.bucket_mb:g} MiB buckets)"
                                                 if cfg.dp_mode == "ddp" else "")
                     + (" · find_unused" if cfg.find_unused else ""))
    if p.pp > 1:
        parts.append(f"schedule {cfg.schedule} (M={cfg.flush_microbatches}, "
                     f"V={cfg.stages_per_rank})")
    if p.tp > 1 and cfg.sequence_parallel:
        parts.append("sequence parallel")
    if p.cp > 1:
        parts.append(f"cp {cfg.cp_method}{' zigzag' if cfg.cp_zigzag else ''}")
    ck = cfg.checkpoint + (f" every {cfg.checkpoint_every}" if cfg.checkpoint == "every"
                           else "")
    parts += [cfg.precision, f"checkpoint {ck}", f"impl {cfg.impl}"]
    if cfg.compile:
        parts.append("compile")
    console.print(" · ".join(parts))
    flushes = (f", {cfg.flush_microbatches} per flush x {cfg.flushes} flush(es)"
               if p.pp > 1 else "")
    console.print(f"global batch {cfg.global_batch} = dp {p.dp} x {cfg.local_batch} per data "
                  f"rank (micro {cfg.micro} x {cfg.accum_steps} microbatches{flushes}) · "
                  f"steps {cfg.steps} · {cfg.global_batch * mc.seq_len:,} tokens per step")


def _coords(m: dict, mesh) -> str:
    c = m.get("coords") or {}
    shown = [f"{a} {c[a]}" for a in MESH_AXES if a in c and getattr(mesh, a) > 1]
    return " ".join(shown) or DASH


def _memory_table(cfg, metrics: list):
    from rich.table import Table

    zero3 = cfg.zero_stage == 3 and any("gathered_units" in (m.get("memory") or {})
                                        .get("working_set", {}) for m in metrics)
    cuda = any((m.get("memory") or {}).get("allocator_peak") is not None for m in metrics)
    t = Table()
    cols = ["rank", "mesh coords", "stages", "step ms", "MFU %",
            "HFU %", "params\nmeas / pred", "grads\nmeas / pred", "optim\nmeas / pred",
            "activ.\npeak", "other\npeak", "total\npeak"]
    cols += ["gathered units\npeak"] if zero3 else []
    cols += ["allocator\npeak"] if cuda else []
    for col in cols:
        t.add_column(col, justify="left" if col == "mesh coords" else "right")
    for m in metrics:
        mem = m.get("memory") or {}
        state, pred, peak = mem.get("model_state", {}), m.get("memory_predicted", {}), \
            mem.get("peak", {})
        row = [str(m["rank"]), _coords(m, cfg.mesh), ",".join(map(str, m.get("stages") or [])),
               f"{m['step_time_s'] * 1e3:.1f}", pct(m.get("mfu")), pct(m.get("hfu")),
               *[pair(state.get(c), pred.get(c), MiB)
                 for c in ("parameters", "gradients", "optimizer")],
               mib(peak.get("activations")), mib(peak.get("other")),
               mib(mem.get("peak_total"))]
        if zero3:
            row.append(mib(mem.get("working_set", {}).get("gathered_units")))
        if cuda:
            row.append(mib(mem.get("allocator_peak")))
        t.add_row(*row)
    return t


def _order(x: str, order: tuple) -> tuple:
    return (order.index(x) if x in order else len(order), x)


def _comm_columns(metrics: list) -> list:
    """``[(axis, op)]`` with bytes counted or predicted on some rank, in mesh-axis and
    collective order; an op that sent nothing anywhere and has no prediction (a recv) is
    left out."""
    cols: set = set()
    for m in metrics:
        meas, pred = m.get("comm_bytes_by_axis") or {}, m.get("comm_predicted_by_axis") or {}
        cols |= {(a, op) for a, ops in meas.items() for op, v in ops.items() if v}
        cols |= {(a, op) for a, ops in pred.items() for op in ops}
    return sorted(cols, key=lambda c: (_order(c[0], AXIS_ORDER), _order(c[1], OP_ORDER)))


def _comm_table(cfg, metrics: list):
    from rich.table import Table

    columns = _comm_columns(metrics)
    formula = any(m.get("dp_formula_bytes") for m in metrics)
    psi = "3Ψ" if cfg.zero_stage == 3 else "2Ψ"
    t = Table()
    t.add_column("rank", justify="right")
    for axis, op in columns:
        t.add_column(f"{axis} {op}\nmeas / pred", justify="right")
    t.add_column("total\nmeas / pred", justify="right")
    if formula:
        t.add_column(f"dp formula\n{psi}·(N-1)/N·B", justify="right")
    if cfg.zero_stage == 3:
        t.add_column("AG hidden\n%", justify="right")
    for m in metrics:
        meas, pred = m.get("comm_bytes_by_axis") or {}, m.get("comm_predicted_by_axis") or {}
        row = [str(m["rank"])]
        for axis, op in columns:
            a, b = meas.get(axis, {}).get(op), pred.get(axis, {}).get(op)
            row.append(DASH if a is None and b is None else pair(a, b, fmt="{:,.0f}"))
        row.append(pair(m.get("comm_bytes_per_step"), m.get("comm_bytes_predicted"),
                        fmt="{:,.0f}"))
        if formula:
            row.append(f"{m.get('dp_formula_bytes') or 0:,.0f}")
        if cfg.zero_stage == 3:
            h = ag_hidden(m)
            row.append(DASH if h is None else f"{100 * h:.1f}")
        t.add_row(*row)
    return t


def _comm_notes(cfg, metrics: list) -> list:
    """Why the prediction differs from the lecture's formula, and what is not traced."""
    notes = []
    mesh, z = cfg.mesh, cfg.zero_stage
    dp_pred = [sum((m.get("comm_predicted_by_axis") or {}).get("dp", {}).values())
               for m in metrics]
    formula = [m.get("dp_formula_bytes") or 0 for m in metrics]
    if any(formula) and any(abs(a - b) > 0.5 for a, b in zip(dp_pred, formula)):
        why = []
        if z:
            why.append("the flat units' padding")
        if z >= 2 and cfg.accum_steps > 1:
            why.append(f"a reduce-scatter{' and two all-gathers' if z == 3 else ''} per "
                       f"microbatch ({cfg.accum_steps} per step)")
        if z == 3 and cfg.keep_last:
            why.append("keep_last (the root unit's backward all-gather is not repeated)")
        if z and mesh.dp_replicate > 1:
            why.append(f"HSDP: sharding within groups of K={mesh.degree('fsdp')} ranks, then "
                       f"an all-reduce of the gradient shards across the M="
                       f"{mesh.dp_replicate} replica groups, 2(M-1)/M·Ψ/K·B")
        if z and cfg.parallel.pp > 1 and cfg.model_config.tie_embeddings:
            why.append("the tied embedding's own all-reduce")
        notes.append(f"dp formula: the lecture's {'3Ψ' if z == 3 else '2Ψ'}·(N-1)/N·B over "
                     f"the N={mesh.degree('dp_cp')} data ranks (Ψ this rank's parameters, B "
                     f"bytes each); the prediction beside the count also accounts for "
                     f"{'; '.join(why) or 'nothing else'}")
    if z == 3 and mesh.degree("fsdp") == 1:
        notes.append("one shard per group (K=1): ZeRO-3 gathers nothing, so AG hidden is "
                     "'—'; the replicas all-reduce their gradients as plain DP does")
    if cfg.impl == "torch" and (z == 3 or cfg.parallel.pp > 1):
        notes.append("PyTorch's FSDP2 and pipelining talk past labkit.comm: their bytes are "
                     "not counted (no prediction is shown for them)")
    return notes

