"""``labkit plan …``: the planner from a terminal.

* ``labkit plan memory --params 7.5e9 --ranks 64 --zero 3`` — model-state bytes per rank.
* ``labkit plan layout --model llama3-405b --cluster llama3-24k --tp 8 --pp 16 --dp 128
  --global-batch 2048 --schedule interleaved --virtual-stages 4 --checkpoint full`` — one
  layout: memory by category, communication per axis, bubble, step time, MFU (``--terms``
  prints every term with its formula and source).
* ``labkit plan search --model llama3-405b --cluster llama3-24k --gpus 16384
  --global-batch 2048 --seq-len 8192`` — the best layouts that fit, and why the others fail.
* ``labkit plan validate`` — the planner against Narayanan et al. 2021 Table 1 and Llama 3's
  Table 4.
* ``labkit plan presets`` — the models, clusters and runtimes it knows.

Every command takes ``--json``. Bad input is ``error: …`` naming the field, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys

__all__ = ["add_plan_parser"]

_SIZE = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10,
         "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def _count(text: str) -> float:
    """``7.5e9``, ``7.5B``, ``70M``, ``1.2T`` → a float count."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    t = text.strip().lower()
    try:
        if t and t[-1] in scale:
            return float(t[:-1]) * scale[t[-1]]
        return float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (try 7.5e9 or 7.5B)") \
            from None


def _bytes(text: str) -> float:
    """``80GiB``, ``75GB``, ``8.5e10`` → bytes."""
    mt = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    if not mt or mt.group(2).lower() not in _SIZE:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 80GiB or 75GB)")
    try:
        v = float(mt.group(1)) * _SIZE[mt.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 80GiB)") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return v


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}") \
            from None


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` with its sub-commands to an ``argparse`` sub-parser group; return it."""
    pl = subparsers.add_parser("plan", help="analytic planning (labkit.plan)",
                               description="Memory, communication, bubble, step time and "
                               "MFU of training layouts at cluster scale (labkit.plan).")
    sub = pl.add_subparsers(dest="what", metavar="{memory,layout,search,validate,presets}",
                            required=True)
    m = sub.add_parser("memory", help="model-state bytes per rank under DP / ZeRO-1..3",
                       description="Bytes of parameters, gradients and Adam state per rank.")
    m.add_argument("--params", type=_count, required=True,
                   help="parameters, e.g. 7.5e9 or 7.5B")
    m.add_argument("--ranks", type=int, default=1, help="data-parallel ranks sharing the state")
    m.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    m.add_argument("--fp32", action="store_true", help="fp32 training (4/4/8 bytes per "
                   "parameter) instead of mixed precision (2/2/12)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_memory)

    lay = sub.add_parser("layout", help="one layout: memory, communication, bubble, MFU",
                         description="Estimate one [TP, CP, PP, DP] layout of a model on a "
                         "cluster.")
    _common(lay)
    for axis in ("tp", "cp", "pp", "dp"):
        lay.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree (default 1)")
    lay.add_argument("--zero", type=int, default=1, help="ZeRO stage 0-3 (default 1)")
    lay.add_argument("--microbatch", type=int, default=1, help="sequences per microbatch")
    lay.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved")
    lay.add_argument("--virtual-stages", type=int, default=1, help="model chunks per "
                     "pipeline rank (interleaved)")
    lay.add_argument("--checkpoint", default="none", help="none, selective or full")
    lay.add_argument("--no-sp", dest="sp", action="store_false",
                     help="no sequence parallelism")
    lay.add_argument("--dp-shard", type=int, default=None,
                     help="HSDP: ZeRO-3 inside groups of this many data-parallel ranks")
    lay.add_argument("--ep", type=int, default=1, help="expert parallelism over the dp x cp "
                     "ranks (mixture-of-experts models; default 1)")
    lay.add_argument("--terms", action="store_true", help="print every term with its "
                     "formula and source")
    lay.set_defaults(func=cmd_layout)

    se = sub.add_parser("search", help="the best layouts that fit, and why others fail",
                        description="Search [TP, CP, PP, DP], ZeRO, microbatch, schedule and "
                        "recomputation for the fastest layouts under the memory limit.")
    _common(se)
    se.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    for axis in ("tp", "cp", "pp", "dp"):
        se.add_argument(f"--{axis}", type=_ints, default=None, metavar="N[,N...]",
                        help=f"{axis} degrees to try (default: all sensible)")
    se.add_argument("--zero", type=_ints, default=[1, 2, 3], metavar="Z[,Z...]")
    se.add_argument("--microbatch", type=_ints, default=[1, 2, 4], metavar="B[,B...]")
    se.add_argument("--checkpoint", type=_words, default=["none", "selective", "full"],
                    metavar="P[,P...]")
    se.add_argument("--top", type=int, default=10, help="plans to show (default 10)")
    se.add_argument("--rejected", type=int, default=8,
                    help="rejected layouts to show as examples (default 8)")
    se.set_defaults(func=cmd_search)

    va = sub.add_parser("validate", help="the planner against published training runs",
                        description="Narayanan et al. 2021 Table 1 and Llama 3 Table 4.")
    va.add_argument("--json", action="store_true")
    va.set_defaults(func=cmd_validate)
    pr = sub.add_parser("presets", help="models, clusters and runtimes the planner knows")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_presets)
    return pl


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3-8b", help="model preset (labkit plan presets)")
    p.add_argument("--cluster", default="h100-server", help="cluster preset")
    p.add_argument("--runtime", default="llama3-2024", help="llama3-2024, megatron-2021 or "
                   "labkit-fp32 (labkit's own job)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: 8 per data-parallel rank)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    p.add_argument("--memory-limit", type=_bytes, default=None,
                   help="bytes per GPU, e.g. 75GiB (default: the GPU's HBM)")
    p.add_argument("--json", action="store_true")


def _fail(exc: Exception) -> int:
    print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


def _console():
    from labkit.cli.fmt import make_console

    return make_console()


def cmd_memory(args) -> int:
    from labkit.plan.memory import GB, GiB, model_state_bytes

    try:
        out = model_state_bytes(args.params, args.ranks, args.zero,
                                mixed_precision=not args.fp32)
    except ValueError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps({"params": args.params, "ranks": args.ranks, "zero": args.zero,
                          "precision": "fp32" if args.fp32 else "mixed", "bytes": out}))
        return 0
    from rich.table import Table

    console = _console()
    prec = "fp32 (4/4/8 B/param)" if args.fp32 else "mixed (2/2/12 B/param)"
    console.print(f"model state per rank · {args.params:.4g} params · {args.ranks} ranks · "
                  f"ZeRO-{args.zero} · {prec}")
    t = Table()
    for col in ("category", "bytes", "GB", "GiB", "B/param"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for cat in ("parameters", "gradients", "optimizer", "total"):
        v = out[cat]
        t.add_row(cat, f"{v:,.0f}", f"{v / GB:,.3f}", f"{v / GiB:,.3f}",
                  f"{v / args.params:.3g}" if args.params else "–")
    console.print(t)
    return 0


def cmd_layout(args) -> int:
    from labkit.plan.estimate import estimate
    from labkit.plan.layout import Layout

    try:
        gb = args.global_batch if args.global_batch is not None else 8 * args.dp
        lay = Layout(tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp, zero=args.zero,
                     microbatch=args.microbatch, global_batch=gb, seq_len=args.seq_len,
                     schedule=args.schedule, virtual_stages=args.virtual_stages,
                     checkpoint=args.checkpoint, sequence_parallel=args.sp,
                     dp_shard=args.dp_shard, ep=args.ep)
        plan = estimate(args.model, args.cluster, lay, args.runtime, args.memory_limit)
    except ValueError as exc:
        return _fail(exc)
    if args.json:
        _dump(plan.summary())
        return 0
    from labkit.plan.cli_render import render_plan

    render_plan(_console(), plan, terms=args.terms)
    return 0


def cmd_search(args) -> int:
    from labkit.plan.search import search

    try:
        gb = args.global_batch if args.global_batch is not None else 1024
        res = search(args.model, args.cluster, args.gpus, gb, args.seq_len,
                     runtime=args.runtime, memory_limit=args.memory_limit, top=args.top,
                     tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp, zero=args.zero,
                     microbatch=args.microbatch, checkpoint=args.checkpoint)
    except ValueError as exc:
        return _fail(exc)
    if args.json:
        _dump({
            "n_gpus": res.n_gpus, "considered": res.considered, "fitting": res.fitting,
            "dominated": res.dominated, "plans": [p.summary() for p in res.plans],
            "rejected_counts": res.reason_counts(),
            "rejected": [{"layout": _layout_dict(r.layout), "reason": r.reason}
                         for r in res.rejected]})
        return 0
    from labkit.plan.cli_render import render_search

    render_search(_console(), res, args)
    return 0


def cmd_validate(args) -> int:
    from labkit.plan.published import (LLAMA3_TABLE4, NARAYANAN_TABLE1, predict_llama3_row,
                                       predict_megatron_row)

    meg = [predict_megatron_row(r) for r in NARAYANAN_TABLE1]
    lla = [predict_llama3_row(r) for r in LLAMA3_TABLE4]
    if args.json:
        _dump({
            "narayanan_2021_table1": [
                {"model": x["row"].model, "published_tflops": x["row"].tflops,
                 "predicted_tflops": x["tflops"], "error": x["error"],
                 "layout": _layout_dict(x["plan"].layout)} for x in meg],
            "llama3_table4": [
                {"gpus": x["row"].gpus, "seq_len": x["row"].seq_len,
                 "published_tflops": x["row"].tflops, "predicted_tflops": x["tflops"],
                 "error": x["error"], "layout": _layout_dict(x["plan"].layout)}
                for x in lla]})
        return 0
    from labkit.plan.cli_render import render_validate

    render_validate(_console(), meg, lla)
    return 0


def cmd_presets(args) -> int:
    from labkit.plan.hardware import CLUSTERS
    from labkit.plan.models import PLAN_MODELS
    from labkit.plan.runtime import RUNTIMES

    data = {"models": {k: {"params": m.params, "layers": m.n_layers, "hidden": m.d_model,
                           "heads": m.n_heads, "kv_heads": m.n_kv_heads, "seq_len": m.seq_len,
                           "source": m.source} for k, m in PLAN_MODELS.items()},
            "clusters": {k: {"gpus": c.n_gpus, "gpu": c.gpu.name,
                             "levels": [(lv.name, lv.size, lv.bandwidth) for lv in c.levels],
                             "source": c.source} for k, c in CLUSTERS.items()},
            "runtimes": {k: r.source for k, r in RUNTIMES.items()}}
    if args.json:
        _dump(data)
        return 0
    from labkit.plan.cli_render import render_presets

    render_presets(_console(), data)
    return 0


def _layout_dict(layout) -> dict:
    from dataclasses import asdict

    d = asdict(layout)
    d["order"] = list(layout.order)
    return d


def _clean(x):
    """JSON-safe: infinite or undefined floats become ``null``."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _dump(obj) -> None:
    print(json.dumps(_clean(obj), allow_nan=False, default=str))
