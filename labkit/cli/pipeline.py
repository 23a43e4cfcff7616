"""The bubble section of ``labkit run --pp P``: measured beside simulated, rung by rung.

:func:`render_bubble` prints :func:`labkit.parallel.pipeline.report.pipeline_report`'s
answer for the first pipeline (with data parallelism several run at once; the bubble is
read from one): a line with the schedule and the measured one-way p2p time per hop, one
row per pipeline rank (busy and idle per flush measured / simulated, peak activations,
in-flight microbatches measured / simulated), the bubble and its MFU ceiling
(1 − bubble), the simulator's own summary, the ladder from the formula's unit costs to the
executor's overheads, and notes on what may distort the numbers.
"""
from __future__ import annotations

import os

from .fmt import DASH, MiB, pair

__all__ = ["render_bubble", "pipeline_notes"]


def pipeline_notes(cfg, rep, info: dict) -> list:
    """What a reader needs to trust (or distrust) a pipeline run's bubble numbers."""
    notes = []
    pp = cfg.parallel.pp
    f_ms = 1e3 * sum(rep.costs["F"]) / len(rep.costs["F"])
    over_ms = 1e3 * (rep.hop_s + rep.dispatch_s)
    if over_ms > 0.2 * f_ms:
        notes.append(f"a stage's forward takes {f_ms:.2f} ms and the executor spends "
                     f"{over_ms:.2f} ms (hop + dispatch) around each action: the '+ executor' "
                     "rung shows how much of the bubble that is; a wider model (labkit."
                     "parallel.pipeline.PP_BALANCED, benchmarks/pipeline_bubble.py) or a GPU "
                     "per rank times the schedule itself")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    world = cfg.parallel.world_size
    if info.get("backend") == "gloo" and cores and world > cores:
        notes.append(f"{world} ranks share {cores} CPU cores: spans stretch while a rank "
                     "waits for a core, and timings vary from run to run")
    if rep.flushes < 3:
        notes.append(f"only {rep.flushes} flush(es) measured, and so few are noisy: "
                     "--steps 5 or more averages several")
    if cfg.model_config.tie_embeddings and pp > 1:
        notes.append("the first and the last pipeline rank each hold the tied embedding "
                     "(counted in both ranks' model state); their gradients are summed "
                     "every step")
    return notes


def render_bubble(console, cfg, pipe: dict, info: dict) -> None:
    """Print the bubble section; ``pipe`` is ``pipeline_report(cfg, metrics, trace)``."""
    from rich.table import Table

    s, rep = pipe["summary"], pipe["bubble"]
    dp = cfg.parallel.dp
    which = f" · the first of {dp} pipelines" if dp > 1 else ""
    console.print(f"pipeline · schedule {cfg.schedule} · P={cfg.parallel.pp} "
                  f"M={cfg.flush_microbatches} V={cfg.stages_per_rank}{which} · "
                  f"{rep.flushes} flush(es) measured "
                  f"({'step 0 skipped' if cfg.steps > 1 else 'the only step, step 0'}) · "
                  f"one-way p2p {1e3 * s['p2p_latency_s']:.2f} ms per hop")
    console.print("per pipeline rank: busy and idle per flush, measured / simulated (the "
                  "simulator fed the measured per-stage F/B/W costs + the p2p time per hop)")
    t = Table()
    for col in ("pp rank", "global rank", "stages", "busy ms", "idle ms\nmeas / sim",
                "idle %\nmeas / sim", "activ. MiB\npeak meas", "in-flight µb\nmeas / sim"):
        t.add_column(col, justify="right")
    for row in pipe["rows"]:
        t.add_row(str(row["rank"]), str(row["global_rank"]),
                  ",".join(map(str, row["stages"] or [])), f"{row['busy_s'] * 1e3:.2f}",
                  pair(row["idle_s"], row["predicted_idle_s"], 1e-3, "{:.2f}"),
                  pair(row["idle_frac"], row["predicted_idle_frac"], 0.01, "{:.1f}"),
                  DASH if row["peak_activation_bytes"] is None
                  else f"{row['peak_activation_bytes'] / MiB:.3f}",
                  pair(row["peak_inflight"], row["predicted_inflight"], fmt="{:.0f}"))
    console.print(t)
    mfu = DASH if s["mfu"] is None else f"{100 * s['mfu']:.2f} %"
    console.print(f"bubble (idle / total): measured {100 * s['bubble']:.1f} % · simulated "
                  f"{100 * s['bubble_simulated']:.1f} % · MFU ceiling (1 − bubble): measured "
                  f"{100 * s['mfu_ceiling']:.1f} % / simulated "
                  f"{100 * s['mfu_ceiling_simulated']:.1f} % · MFU (the pipeline) {mfu}")
    console.print(rep.summary())
    console.print(f"bubble, rung by rung: {rep.ladder_text()}")
    for note in pipeline_notes(cfg, rep, info):
        console.print(f"note: {note}")
