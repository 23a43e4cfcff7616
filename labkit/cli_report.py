"""What ``labkit run`` prints: a table per rank, measured beside predicted, or JSON.

:func:`render_run` (plain data parallelism, :func:`labkit.train.run`'s metrics): step time,
MFU, model-state memory beside :mod:`labkit.plan`, all-reduce bytes beside 2(N−1)/N·|θ|·4.
:func:`render_zero` (:func:`labkit.parallel.zero_jobs.zero_train`'s metrics, ``--zero``):
memory by category (model state measured beside ``model_state_bytes`` of the stage and
shard count, activations and other at the peak, the gathered-unit working set beside its
prediction) and bytes per collective (all-reduce / reduce-scatter / all-gather) beside
``comm_predicted_by_op``, with the lecture's total (2Ψ / 3Ψ · (K−1)/K · bytes) and, at
stage 3, the fraction of all-gather time hidden under compute. Sizes in MiB, bytes in B.
:func:`render_pipeline` (``--pp``, :func:`labkit.parallel.pipeline.lab.pipeline_report`):
the bubble measured from the trace beside the simulator, then per rank idle time, peak
activation memory and in-flight microbatches (measured / simulated), model state and MFU.
Both launchers (own cluster, torchrun) print through here; rich is imported on use.
"""
from __future__ import annotations

import dataclasses
import json
import sys

__all__ = ["report", "render", "render_run", "render_zero", "render_pipeline", "run_json",
           "global_losses", "make_console"]

MiB = 2 ** 20
#: collectives in the order the ZeRO table lists them
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def report(cfg, outputs: list, info: dict, as_json: bool = False, trace=None) -> None:
    """Print a finished run as a table or (``as_json``) one JSON object. A pipeline run
    (``cfg`` a ``PipelineConfig``) needs the merged ``trace`` for its bubble."""
    pipe = None
    if hasattr(cfg, "schedule"):
        from .parallel.pipeline.lab import pipeline_report

        pipe = pipeline_report(cfg, [o["metrics"] for o in outputs], trace)
    if as_json:
        out = run_json(cfg, outputs, info)
        if pipe is not None:
            out["pipeline"] = {k: pipe[k] for k in ("summary", "rows")}
        print(json.dumps(out, default=str))
    elif pipe is not None:
        render_pipeline(cfg, outputs, info, pipe)
    else:
        render(cfg, outputs, info)


def render(cfg, outputs: list, info: dict, console=None) -> None:
    """:func:`render_zero` for a ``ZeroConfig`` run, else :func:`render_run`."""
    (render_zero if hasattr(cfg, "zero_stage") else render_run)(cfg, outputs, info, console)


def global_losses(outputs: list) -> list:
    """Per-step loss of the global batch: the mean over ranks of each rank's loss (ranks
    that report none, e.g. a pipeline's middle stages, are left out)."""
    losses = [o["losses"] for o in outputs if o.get("losses")]
    return [sum(ls[s] for ls in losses) / len(losses) for s in range(len(losses[0]))]


def run_json(cfg, outputs: list, info: dict) -> dict:
    """Plain-data report of a run: config, global losses, per-rank losses and metrics."""
    m0 = outputs[0]["metrics"]
    # a pipeline rank holds only its stages: report the model's count (model_params)
    return {"model": m0["model"], "n_params": m0.get("model_params", m0["n_params"]),
            "world_size": len(outputs),
            **info, "config": dataclasses.asdict(cfg), "losses": global_losses(outputs),
            "ranks": [{"rank": r, "losses": o["losses"], "metrics": o["metrics"]}
                      for r, o in enumerate(outputs)]}


def pipeline_notes(cfg, rep, info: dict) -> list:
    """What a reader needs to trust (or distrust) a pipeline run's bubble numbers."""
    import os

    notes = []
    f_ms = 1e3 * sum(rep.costs["F"]) / len(rep.costs["F"])
    over_ms = 1e3 * (rep.hop_s + rep.dispatch_s)
    if over_ms > 0.2 * f_ms:
        notes.append(f"a stage's forward takes {f_ms:.2f} ms and the executor spends "
                     f"{over_ms:.2f} ms (hop + dispatch) around each action: the '+ executor' "
                     "rung shows how much of the bubble that is; a wider model (labkit."
                     "parallel.pipeline.PP_BALANCED, benchmarks/pipeline_bubble.py) or a GPU "
                     "per rank times the schedule itself")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if info.get("backend") == "gloo" and cores and cfg.pp > cores:
        notes.append(f"{cfg.pp} ranks share {cores} CPU cores: spans stretch while a rank "
                     "waits for a core, and timings vary from run to run")
    if rep.flushes < 3:
        notes.append(f"only {rep.flushes} flush(es) measured, and so few are noisy: "
                     "--steps 5 or more averages several")
    if cfg.model_config.tie_embeddings and cfg.pp > 1:
        notes.append("model state counts the tied embedding on both the first and the last "
                     "rank: each holds a copy, and their gradients are summed every step")
    return notes


def make_console():
    """A rich ``Console``: 180 columns when piped (CI logs, tests), the terminal otherwise."""
    from rich.console import Console

    # piped output (CI logs, tests) gets a fixed, wide layout instead of 80 columns
    return Console(highlight=False, width=None if sys.stdout.isatty() else 180)


def _pair(measured, predicted, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    a = "–" if measured is None else fmt.format(measured / scale)
    b = "–" if predicted is None else fmt.format(predicted / scale)
    return f"{a} / {b}"


def render_run(cfg, outputs: list, info: dict, console=None) -> None:
    """Print the header line and one table row per rank (shared by both launchers)."""
    from rich.table import Table

    console = console or make_console()
    m0 = outputs[0]["metrics"]
    console.print(f"labkit run · model {m0['model']} · {m0['n_params']:,} params · "
                  f"world {len(outputs)} · backend {info.get('backend', '?')} · "
                  f"launcher {info.get('launcher', '?')} · dp_mode {cfg.dp_mode} · "
                  f"global batch {cfg.global_batch} (micro {cfg.micro} x {cfg.accum_steps}"
                  f" accum) · steps {cfg.steps}")
    t = Table(title=None, show_lines=False)
    t.add_column("rank", justify="right")
    t.add_column("step ms", justify="right")
    t.add_column("MFU %", justify="right")
    for cat in ("params", "grads", "optim"):
        t.add_column(f"{cat} MiB\nmeas / pred", justify="right")
    t.add_column("activ. MiB\npeak", justify="right")
    t.add_column("all-reduce B/step\nmeas / 2(N-1)/N·|θ|·4", justify="right")
    t.add_column("final loss", justify="right")
    for r, out in enumerate(outputs):
        m = out["metrics"]
        mem = m.get("memory") or {}
        state, pred = mem.get("model_state", {}), m.get("memory_predicted", {})
        act = mem.get("peak", {}).get("activations")
        t.add_row(str(r), f"{m['step_time_s'] * 1e3:.1f}",
                  "–" if m.get("mfu") is None else f"{100 * m['mfu']:.2f}",
                  *[_pair(state.get(c), pred.get(c), MiB)
                    for c in ("parameters", "gradients", "optimizer")],
                  "–" if act is None else f"{act / MiB:.3f}",
                  _pair(m.get("comm_bytes_per_step"), m.get("comm_bytes_predicted"),
                        fmt="{:,.0f}"),
                  f"{out['losses'][-1]:.4f}")
    console.print(t)
    _footer(console, outputs, info)


def _footer(console, outputs: list, info: dict) -> None:
    losses = global_losses(outputs)
    tail = f" · trace → {info['trace']}" if info.get("trace") else ""
    console.print(f"global loss (mean over ranks) {losses[0]:.4f} → {losses[-1]:.4f} · "
                  f"wall {info.get('wall_s', 0.0):.1f} s{tail}")


def render_zero(cfg, outputs: list, info: dict, console=None) -> None:
    """Print a ZeRO / FSDP / HSDP run: a header, memory by category per rank and bytes per
    collective per rank, each measured beside predicted (``cfg`` is a ``ZeroConfig``)."""
    from rich.table import Table

    console = console or make_console()
    run, m0 = cfg.run, outputs[0]["metrics"]
    stage, k, m = m0["zero_stage"], m0["shards"], m0["replicas"]
    knobs = f"prefetch {'on' if cfg.prefetch else 'off'}" if stage == 3 else ""
    prec = "bf16 + fp32 master" if cfg.mixed_precision else "fp32"
    console.print(f"labkit run · model {m0['model']} · {m0['n_params']:,} params · "
                  f"world {len(outputs)} · backend {info.get('backend', '?')} · "
                  f"launcher {info.get('launcher', '?')} · global batch {run.global_batch} "
                  f"(micro {run.micro} x {run.accum_steps} accum) · steps {run.steps}")
    console.print(f"ZeRO-{stage} · K={k} shards × M={m} replicas · {prec}"
                  f"{' · ' + knobs if knobs else ''}")
    mem = Table(title="memory per rank, MiB (model state: largest over the step / "
                f"labkit.plan ZeRO-{stage}, K={k})")
    for col in ("rank", "step ms", "MFU %", "params\nmeas / pred", "grads\nmeas / pred",
                "optim\nmeas / pred", "activ.\npeak", "other\npeak",
                "gathered units\nmeas / pred"):
        mem.add_column(col, justify="right")
    comm = Table(title="bytes per collective per rank per step, measured / predicted")
    comm.add_column("rank", justify="right")
    for op in OPS:
        comm.add_column(f"{op}\nmeas / pred", justify="right")
    factor = "3Ψ" if stage == 3 else "2Ψ"
    comm.add_column(f"total\nmeas / {factor}·(K-1)/K·B", justify="right")
    comm.add_column("AG hidden\n%", justify="right")
    for r, out in enumerate(outputs):
        mt = out["metrics"]
        mm = mt.get("memory") or {}
        state, pred, peak = mm.get("model_state", {}), mt.get("memory_predicted", {}), \
            mm.get("peak", {})
        ws = mm.get("working_set", {})
        mem.add_row(str(r), f"{mt['step_time_s'] * 1e3:.1f}",
                    "–" if mt.get("mfu") is None else f"{100 * mt['mfu']:.2f}",
                    *[_pair(state.get(c), pred.get(c), MiB)
                      for c in ("parameters", "gradients", "optimizer")],
                    *["–" if peak.get(c) is None else f"{peak[c] / MiB:.3f}"
                      for c in ("activations", "other")],
                    _pair(ws.get("gathered_units"), ws.get("gathered_units_predicted"), MiB)
                    if "gathered_units" in ws else "–")
        meas, pop = mt.get("comm_bytes_by_op") or {}, mt.get("comm_predicted_by_op") or {}
        hidden = (mt.get("overlap") or {}).get("total")
        comm.add_row(str(r), *[_pair(meas.get(op), pop.get(op), fmt="{:,.0f}")
                               if op in meas or op in pop else "–" for op in OPS],
                     _pair(mt.get("comm_bytes_per_step"), mt.get("comm_bytes_predicted"),
                           fmt="{:,.0f}"),
                     "–" if hidden is None else f"{100 * hidden:.1f}")
    console.print(mem)
    console.print(comm)
    saved = m0.get("comm_saved_keep_last") or 0
    if saved:
        console.print(f"keep_last: the root unit stays gathered into backward, so its "
                      f"all-gather ({saved:,.0f} B) is not repeated; the per-op prediction "
                      f"is the lecture's {factor} minus that")
    if m > 1:
        console.print(f"HSDP: the all-reduce of the gradient shards across the M={m} replica "
                      f"groups (2(M-1)/M·Ψ/K·B) is outside the lecture's {factor} within a group")
    _footer(console, outputs, info)


def render_pipeline(cfg, outputs: list, info: dict, pipe: dict, console=None) -> None:
    """Print a pipeline run: a header (saying when the model was deepened to one layer per
    stage), the bubble summary, one row per rank and the bubble / MFU footer. ``pipe`` is
    :func:`~labkit.parallel.pipeline.lab.pipeline_report`'s answer."""
    from rich.table import Table

    from .config import preset

    console = console or make_console()
    m0, s, rep = outputs[0]["metrics"], pipe["summary"], pipe["bubble"]
    layers = f"{m0['n_layers']} layers"
    base = preset(cfg.model).n_layers if isinstance(cfg.model, str) else None
    if cfg.n_layers and base is not None and base != cfg.n_layers:
        why = " = pp x V, one per stage" if cfg.n_layers == cfg.n_stages else ""
        layers += f" (preset {cfg.model!r} has {base}; set to {cfg.n_layers}{why})"
    console.print(f"labkit run · pipeline · model {m0['model']} · {layers} · "
                  f"{m0['model_params']:,} params · world {len(outputs)} · backend "
                  f"{info.get('backend', '?')} · launcher {info.get('launcher', '?')}")
    console.print(f"schedule {cfg.schedule} · P={cfg.pp} M={cfg.microbatches} "
                  f"V={cfg.stages_per_rank} · global batch {cfg.global_batch} (micro "
                  f"{cfg.micro} x {cfg.microbatches} microbatches x {cfg.accum_steps} accum) · "
                  f"steps {cfg.steps} · {rep.flushes} flush(es) measured "
                  f"({'step 0 skipped' if cfg.steps > 1 else 'the only step, step 0'}) · "
                  f"one-way p2p {1e3 * s['p2p_latency_s']:.2f} ms per hop")
    t = Table(title="per rank: busy and idle per flush, measured / simulated (simulator fed "
              "the measured per-stage F/B/W costs + the p2p time per hop); step = flush + "
              "optimizer")
    for col in ("rank", "stages", "step ms", "busy ms", "idle ms\nmeas / sim",
                "idle %\nmeas / sim", "activ. MiB\npeak meas", "in-flight µb\nmeas / sim",
                "model state MiB\n4/4/8 B/param", "MFU %"):
        t.add_column(col, justify="right")
    for row in pipe["rows"]:
        ms = row["model_state"] or {}
        t.add_row(str(row["rank"]), ",".join(map(str, row["stages"] or [])),
                  f"{row['step_time_s'] * 1e3:.1f}", f"{row['busy_s'] * 1e3:.2f}",
                  _pair(row["idle_s"], row["predicted_idle_s"], 1e-3, "{:.2f}"),
                  _pair(row["idle_frac"], row["predicted_idle_frac"], 0.01, "{:.1f}"),
                  "–" if row["peak_activation_bytes"] is None
                  else f"{row['peak_activation_bytes'] / MiB:.3f}",
                  _pair(row["peak_inflight"], row["predicted_inflight"], fmt="{:.0f}"),
                  "–" if "total" not in ms else f"{ms['total'] / MiB:.3f}",
                  "–" if row["mfu"] is None else f"{100 * row['mfu']:.2f}")
    console.print(t)
    mfu = "–" if s["mfu"] is None else f"{100 * s['mfu']:.2f} %"
    console.print(f"bubble (idle / total): measured {100 * s['bubble']:.1f} % · simulated "
                  f"{100 * s['bubble_simulated']:.1f} % · MFU ceiling (1 − bubble): measured "
                  f"{100 * s['mfu_ceiling']:.1f} % / simulated "
                  f"{100 * s['mfu_ceiling_simulated']:.1f} % · MFU (all ranks) {mfu}")
    console.print(rep.summary())
    console.print(f"bubble, rung by rung: {rep.ladder_text()}")
    for note in pipeline_notes(cfg, rep, info):
        console.print(f"note: {note}")
    losses = global_losses(outputs)
    tail = f" · trace → {info['trace']}" if info.get("trace") else ""
    console.print(f"loss (global batch) {losses[0]:.4f} → {losses[-1]:.4f} · wall "
                  f"{info.get('wall_s', 0.0):.1f} s{tail}")
