"""Colours, name families and small formatters shared by the labkit widgets.

Kept in one place so that a colour means the same thing in every view (backward is always
the same orange, an all-reduce always the same purple) and numbers read the same way
(bytes in MiB, times in ms).
"""
from __future__ import annotations

import html
import json
from typing import Iterable, Optional, Sequence

MiB = float(2 ** 20)

#: the lecture's MFU bars (claim C22): above 30 % is good, above 40 % excellent
MFU_GOOD, MFU_EXCELLENT = 0.30, 0.40

#: compute spans, by name family (see :func:`compute_family`)
COMPUTE_COLORS = {"forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B",
                  "other": "#9D9D9D"}

#: communication spans, by op family (see :func:`comm_family`)
COMM_COLORS = {"all_reduce": "#B279A2", "reduce_scatter": "#E45756", "all_gather": "#72B7B2",
               "all_to_all": "#EECA3B", "broadcast": "#FF9DA6", "reduce": "#9D755D",
               "p2p": "#17BECF", "other": "#BAB0AC"}

#: time the compute thread sat blocked on a collective (FSDP's all-gather waits)
BLOCKED_COLOR = "#3B3B3B"

#: memory categories, in stacking order (bottom first)
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")
MEMORY_COLORS = {"parameters": "#4C78A8", "gradients": "#F58518", "optimizer": "#54A24B",
                 "activations": "#E45756", "other": "#9D9D9D"}

ERROR_RED, OK_GREEN, MUTED = "#C0392B", "#2E7D32", "#555555"

#: background of a step run under extra instrumentation (e.g. the memory tracker)
INSTRUMENTED_COLOR = "#FFE08A"

#: what prose may call each colour above. Notebooks name colours ("the mauve all-reduce
#: bars"); tests/test_notebook_prose.py holds every named colour against the legend entry
#: it describes, so a palette change that leaves the prose behind fails a test.
COLOR_NAMES = {"#4C78A8": ("blue",), "#F58518": ("orange",), "#54A24B": ("green",),
               "#9D9D9D": ("grey", "gray"), "#B279A2": ("mauve", "purple"),
               "#E45756": ("red",), "#72B7B2": ("teal",), "#EECA3B": ("yellow",),
               "#FF9DA6": ("pink",), "#9D755D": ("brown",), "#17BECF": ("cyan",),
               "#BAB0AC": ("light grey", "light gray", "grey", "gray"),
               "#3B3B3B": ("near-black", "black", "dark grey", "dark gray")}


def compute_family(name: str) -> str:
    """``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"`` for a region name.

    ``"layers.1.backward"`` → backward; ``"optimizer.step"`` / ``"optim"`` → optimizer.
    """
    n = (name or "").lower()
    for fam, keys in (("backward", ("backward", "bwd")), ("forward", ("forward", "fwd")),
                      ("optimizer", ("optim",))):
        if any(k in n for k in keys):
            return fam
    return "other"


def comm_family(op: Optional[str]) -> str:
    """The :data:`COMM_COLORS` key of a collective or point-to-point op."""
    o = (op or "").lower()
    if o in COMM_COLORS:
        return o
    if o in ("send", "recv", "isend", "irecv", "send_recv"):
        return "p2p"
    return "other"


def mib(n_bytes: Optional[float]) -> float:
    """Bytes → MiB (``None`` → 0)."""
    return float(n_bytes or 0) / MiB


def fmt_bytes(n: Optional[float]) -> str:
    """Human bytes: ``"512 B"``, ``"3.2 KiB"``, ``"1.50 MiB"``, ``"2.00 GiB"``."""
    if n is None:
        return "–"
    n = float(n)
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit != "KiB" else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def fmt(x, spec: str = ".3g", missing: str = "–") -> str:
    """``format(x, spec)``, or ``missing`` for ``None``."""
    return missing if x is None else format(x, spec)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order (``[1]`` for ``n < 1``)."""
    n = int(n)
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else [1]


def status_html(text: str, kind: str = "info") -> str:
    """One status line; ``kind`` is ``"info"``, ``"ok"``, ``"busy"`` or ``"error"`` (red)."""
    color = {"error": ERROR_RED, "ok": OK_GREEN}.get(kind, MUTED)
    weight = "bold" if kind == "error" else "normal"
    icon = {"error": "✖ ", "ok": "✔ ", "busy": "⏳ "}.get(kind, "")
    return (f'<div class="labkit-status labkit-status-{kind}" style="color:{color};'
            f'font-weight:{weight};font-family:monospace;white-space:pre-wrap">'
            f"{icon}{html.escape(text)}</div>")


def table_html(rows: Sequence[dict], columns: Sequence[tuple], highlight_last: bool = True) -> str:
    """An HTML ``<table>``; ``columns`` are ``(header, key, formatter)`` triples."""
    head = "".join(f"<th style='padding:2px 8px;text-align:right'>{html.escape(h)}</th>"
                   for h, _k, _f in columns)
    body = []
    for i, row in enumerate(rows):
        style = " style='font-weight:bold'" if highlight_last and i == len(rows) - 1 else ""
        cells = "".join(f"<td style='padding:2px 8px;text-align:right'>"
                        f"{html.escape(f(row.get(k)))}</td>" for _h, k, f in columns)
        body.append(f"<tr{style}>{cells}</tr>")
    if not body:
        body.append(f"<tr><td colspan='{len(columns)}' style='color:{MUTED}'>no runs yet</td></tr>")
    return (f"<table class='labkit-history' style='border-collapse:collapse;font-size:12px'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def static_bundle(fig) -> dict:
    """The ``application/vnd.plotly.v1+json`` mimetype of ``fig``: what JupyterLab (and a
    saved notebook) renders without a live widget model."""
    import plotly.io as pio

    return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(fig, validate=False))}


def mean(xs: Iterable[Optional[float]]) -> Optional[float]:
    """Mean of the non-``None`` values, or ``None`` when there are none."""
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None
