"""``labkit plan memory``: model-state bytes per rank under DP / ZeRO-1..3.

``labkit plan memory --params 7.5e9 --ranks 64 --zero 3`` prints parameters, gradients
and Adam state per rank (:func:`labkit.plan.model_state_bytes`), as a table or ``--json``.
The whole ``plan`` command lives here, behind :func:`add_plan_parser`, so a fuller planner
module exposing the same function can take its place (see :func:`labkit.cli.build_parser`).
"""
from __future__ import annotations

import argparse
import json

from .common import UsageError

__all__ = ["add_plan_parser", "count"]


def count(text: str) -> float:
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


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` (with ``memory``) to an ``argparse`` sub-parser group; return it."""
    pl = subparsers.add_parser("plan", help="analytic planning (labkit.plan)")
    sub = pl.add_subparsers(dest="what", metavar="{memory}", required=True)
    m = sub.add_parser("memory", help="model-state bytes per rank under DP / ZeRO-1..3",
                       description="Bytes of parameters, gradients and Adam state per rank.")
    m.add_argument("--params", type=count, required=True,
                   help="parameters, e.g. 7.5e9 or 7.5B")
    m.add_argument("--ranks", type=int, default=1, help="data-parallel ranks sharing the state")
    m.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage")
    m.add_argument("--fp32", action="store_true", help="fp32 training (4/4/8 bytes per "
                   "parameter) instead of mixed precision (2/2/12)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_memory)
    return pl


def cmd_memory(args) -> int:
    """Print ``model_state_bytes`` for the arguments; ``UsageError`` names bad numbers."""
    from ..plan.memory import GB, GiB, model_state_bytes

    try:
        out = model_state_bytes(args.params, args.ranks, args.zero,
                                mixed_precision=not args.fp32)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"params": args.params, "ranks": args.ranks, "zero": args.zero,
                          "precision": "fp32" if args.fp32 else "mixed", "bytes": out}))
        return 0
    from rich.table import Table

    from .fmt import make_console

    console = make_console()
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
