"""Rich tables for ``labkit plan layout | search | validate | presets``."""
from __future__ import annotations

import math

from labkit.plan.estimate import MEMORY_CATEGORIES

__all__ = ["render_plan", "render_search", "render_validate", "render_presets",
           "layout_label"]

GiB = 2 ** 30


def layout_label(lay) -> str:
    """``tp8 cp1 pp16 dp128 · ZeRO-1 · b1 · interleaved V4 · full``."""
    sched = "" if lay.pp == 1 else (
        f" · {lay.schedule}" + (f" V{lay.virtual_stages}" if lay.virtual_stages > 1 else ""))
    hs = f" · HSDP {lay.dp_shard}" if lay.dp_shard else ""
    ep = f" ep{lay.ep}" if getattr(lay, "ep", 1) > 1 else ""
    return (f"tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp}{ep} · ZeRO-{lay.zero}{hs} · "
            f"b{lay.microbatch}{sched} · {lay.checkpoint}" + (" · SP" if lay.sp else ""))


def _bw(v: float) -> str:
    return "–" if not math.isfinite(v) else f"{v / 1e9:,.0f}"


def render_plan(console, plan, terms: bool = False) -> None:
    """Memory by category, communication per axis (with ``ep``, the expert all-to-all,
    for a mixture-of-experts model), times and MFU of one plan."""
    from rich.table import Table

    lay, m = plan.layout, plan.model
    console.print(f"{m.name} ({_count(m.params)} params, seq {m.seq_len}) on "
                  f"{lay.n_gpus} GPUs of {plan.cluster.name} ({plan.cluster.gpu.name}) · "
                  f"runtime {plan.runtime.name}")
    console.print(f"layout {layout_label(lay)} · global batch {lay.global_batch} sequences, "
                  f"{lay.microbatches} microbatches · coordinates [TP, CP, PP, DP]")
    if m.moe:
        _render_experts(console, plan)
    t = Table(title=f"memory per GPU (pipeline rank {plan.memory_rank})")
    for col in ("category", "GiB", "% of limit"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for cat in MEMORY_CATEGORIES + ("total",):
        v = plan.memory[cat]
        t.add_row(cat, f"{v / GiB:,.2f}", f"{100 * v / plan.memory_limit:.1f}")
    t.add_row("limit", f"{plan.memory_limit / GiB:,.2f}", "100.0")
    console.print(t)
    c = Table(title="communication per GPU and step")
    for col in ("axis", "degree", "level", "GB/s", "GB sent", "time s", "exposed s", "what"):
        c.add_column(col, justify="left" if col in ("axis", "level", "what") else "right")
    # a mixture-of-experts model adds the expert all-to-all (dispatch + combine) as its
    # own axis, timed like the others (labkit.plan.experts.expert_all_to_all_time)
    axes = ("tp", "cp", "pp", "dp") + (("ep",) if m.moe or lay.ep > 1 else ())
    for a in axes:
        x = plan.comm[a]
        c.add_row(a, str(x.degree), x.level, _bw(x.bandwidth), f"{x.bytes / 1e9:,.2f}",
                  f"{x.seconds:.3f}", f"{x.exposed:.3f}", x.desc)
    console.print(c)
    s = Table(title="step")
    s.add_column("quantity")
    s.add_column("value", justify="right")
    tk = plan.terms
    rows = [("bubble (fraction of the pipeline)", f"{plan.bubble:.3f}"),
            ("step time s", f"{plan.step_time:.3f}"),
            ("MFU", f"{100 * plan.mfu:.1f} %"), ("HFU", f"{100 * plan.hfu:.1f} %"),
            ("model TFLOP/s per GPU", f"{plan.tflops_per_gpu:,.0f}"),
            ("tokens/s", f"{lay.global_batch * m.seq_len / plan.step_time:,.0f}")]
    if "t.layer_forward" in tk:
        rows.insert(0, ("layer forward / backward / recompute ms",
                        f"{1e3 * tk['t.layer_forward'].value:.2f} / "
                        f"{1e3 * tk['t.layer_backward'].value:.2f} / "
                        f"{1e3 * tk['t.layer_recompute'].value:.2f}"))
    for k, v in rows:
        s.add_row(k, v)
    console.print(s)
    console.print("fits" if plan.fits else f"does NOT fit: {'; '.join(plan.reasons)}")
    if terms:
        tt = Table(title="terms")
        for col in ("term", "value", "unit", "formula", "source"):
            tt.add_column(col, justify="right" if col == "value" else "left")
        for k, v in plan.terms.items():
            tt.add_row(k, f"{v.value:.4g}", v.unit, v.formula, v.source)
        console.print(tt)


def _render_experts(console, plan) -> None:
    """The mixture-of-experts lines: experts, top-k, router, parameters, all-to-all bytes."""
    m, lay, tk = plan.model, plan.layout, plan.terms
    console.print(f"mixture of experts: {m.n_experts} experts per block, top-{m.top_k}, "
                  f"router {m.d_model}×{m.n_experts}; {m.params:,} parameters in all, "
                  f"{m.layer_matmul_params:,} of a block's active per token (attention + router + "
                  f"{m.top_k} experts); ep={lay.ep}: {m.n_experts // lay.ep} experts of each "
                  f"block per GPU, {plan.rank_params[plan.memory_rank]:,.0f} parameters on "
                  f"pipeline rank {plan.memory_rank}")
    if "moe.all_to_all.total" in tk:
        console.print("all-to-all per MoE layer and microbatch (balanced routing): dispatch "
                      f"{tk['moe.all_to_all.dispatch'].value:,.0f} B + combine "
                      f"{tk['moe.all_to_all.combine'].value:,.0f} B (forward + backward) + "
                      f"counts {tk['moe.all_to_all.counts'].value:,.0f} B per GPU")


def render_search(console, res, args) -> None:
    """The ranked plans and the rejected layouts by reason."""
    from rich.table import Table

    console.print(f"{args.model} on {res.n_gpus} GPUs of {args.cluster}: {res.considered} "
                  f"layouts considered, {res.fitting} fit, {len(res.rejected)} rejected, "
                  f"{res.dominated} dominated (a cheaper recomputation already fits)")
    t = Table(title="best layouts (fastest first)")
    for col in ("#", "tp", "cp", "pp", "dp", "ZeRO", "b", "schedule", "recompute", "GiB",
                "bubble", "step s", "MFU %"):
        t.add_column(col, justify="left" if col in ("schedule", "recompute") else "right")
    for i, p in enumerate(res.plans, 1):
        L = p.layout
        sched = "–" if L.pp == 1 else L.schedule + (f" V{L.virtual_stages}"
                                                   if L.virtual_stages > 1 else "")
        t.add_row(str(i), str(L.tp), str(L.cp), str(L.pp), str(L.dp), str(L.zero),
                  str(L.microbatch), sched, L.checkpoint, f"{p.memory['total'] / GiB:.1f}",
                  f"{p.bubble:.3f}", f"{p.step_time:.2f}", f"{100 * p.mfu:.1f}")
    console.print(t)
    if not res.plans:
        console.print("no layout fits")
    counts = res.reason_counts()
    if counts:
        console.print("rejected, by reason: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    r = Table(title=f"rejected (first {min(args.rejected, len(res.rejected))})")
    r.add_column("layout")
    r.add_column("reason")
    seen = set()
    for rej in res.rejected:
        if len(seen) >= args.rejected:
            break
        if rej.reason in seen:
            continue
        seen.add(rej.reason)
        r.add_row(layout_label(rej.layout), rej.reason)
    if seen:
        console.print(r)


def render_validate(console, meg: list, lla: list) -> None:
    """Planner vs Narayanan et al. 2021 Table 1 and Llama 3 Table 4."""
    from rich.table import Table

    t = Table(title="Narayanan et al. 2021, Table 1 (A100, TFLOP/s per GPU counted with "
                    "their Eq. 3, recomputation included)")
    for col in ("model", "tp", "pp", "dp", "GPUs", "batch", "published", "planner",
                "error %", "planner's b, V"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for x in meg:
        r, L = x["row"], x["plan"].layout
        t.add_row(r.model, str(r.tp), str(r.pp), str(r.dp), str(r.gpus), str(r.batch),
                  f"{r.tflops:.0f}", f"{x['tflops']:.0f}", f"{100 * x['error']:+.1f}",
                  f"{L.microbatch}, {L.virtual_stages}")
    console.print(t)
    u = Table(title="Dubey et al. 2024 (Llama 3 405B), Table 4 (H100, model TFLOP/s per GPU)")
    for col in ("GPUs", "tp", "cp", "pp", "dp", "seq", "published", "planner", "error %",
                "planner's choice"):
        u.add_column(col, justify="right" if col != "planner's choice" else "left")
    for x in lla:
        r = x["row"]
        u.add_row(str(r.gpus), str(r.tp), str(r.cp), str(r.pp), str(r.dp), str(r.seq_len),
                  f"{r.tflops:.0f}", f"{x['tflops']:.0f}", f"{100 * x['error']:+.1f}",
                  layout_label(x["plan"].layout))
    console.print(u)


def render_presets(console, data: dict) -> None:
    from rich.table import Table

    t = Table(title="models")
    for col in ("name", "params (B)", "layers", "hidden", "heads", "kv", "seq", "source"):
        t.add_column(col)
    for k, v in data["models"].items():
        t.add_row(k, f"{v['params'] / 1e9:,.2f}", str(v["layers"]), str(v["hidden"]),
                  str(v["heads"]), str(v["kv_heads"]), str(v["seq_len"]), v["source"])
    console.print(t)
    c = Table(title="clusters")
    for col in ("name", "GPUs", "GPU", "levels (name, GPUs, GB/s per direction)", "source"):
        c.add_column(col)
    for k, v in data["clusters"].items():
        lv = "; ".join(f"{n} {s} @ {b / 1e9:,.0f}" for n, s, b in v["levels"])
        c.add_row(k, str(v["gpus"]), v["gpu"], lv, v["source"])
    console.print(c)
    r = Table(title="runtimes")
    r.add_column("name")
    r.add_column("what it overlaps and stores")
    for k, v in data["runtimes"].items():
        r.add_row(k, v)
    console.print(r)


def _count(n: float) -> str:
    """A parameter count a person reads at a glance: ``405.0B``, ``124.4M``, ``344,896``."""
    if n >= 1e9:
        return f"{n / 1e9:,.1f}B"
    if n >= 1e6:
        return f"{n / 1e6:,.1f}M"
    return f"{int(n):,}"

