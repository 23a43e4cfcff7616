"""Reading :mod:`labkit.collectives.bench` rows: busbw ratios with bootstrap intervals, a rich
table and a plotly figure."""
from __future__ import annotations

import random
import statistics
from typing import Optional, Sequence

from . import HAND_BUILT

__all__ = ["fmt_size", "ratios", "ratio_interval", "table", "figure"]

KiB, MiB = 1024, 1024 ** 2


def fmt_size(n: int) -> str:
    for unit, s in (("GiB", 1024 ** 3), ("MiB", MiB), ("KiB", KiB)):
        if n >= s and n % s == 0:
            return f"{n // s} {unit}"
    return f"{n} B"


def ratios(rows: Sequence[dict], hand: Optional[str] = None, min_bytes: int = 0) -> list:
    """``{"n", "bytes", "ratio"}``: hand-built busbw / native busbw at each N and size, with
    ``"lo", "hi"`` (:func:`ratio_interval`) where the rows carry their ``calls``."""
    by = {(r["n"], r["bytes"], r["algorithm"]): r for r in rows}
    if hand is None and rows:
        hand = HAND_BUILT[rows[0]["op"]]
    out = []
    for (n, b, a), nat in sorted(by.items()):
        h = by.get((n, b, hand))
        if a != "native" or b < min_bytes or h is None or nat["busbw"] <= 0:
            continue
        out.append({"n": n, "bytes": b, "ratio": h["busbw"] / nat["busbw"]})
        if nat.get("calls") and h.get("calls"):
            out[-1]["lo"], out[-1]["hi"] = ratio_interval(nat["calls"], h["calls"])
    return out


def ratio_interval(native: Sequence, hand: Sequence, level: float = 0.9,
                   reps: int = 1000) -> tuple:
    """Bootstrap interval of median(native time) / median(hand-built time), the busbw ratio,
    from ``[round, seconds]`` calls. It resamples whole rounds, since the calls of one round
    share its background load; seeded, so a set of calls always gives the same interval."""
    rounds = sorted({c[0] for c in native} & {c[0] for c in hand})
    nat = {r: [c[1] for c in native if c[0] == r] for r in rounds}
    hnd = {r: [c[1] for c in hand if c[0] == r] for r in rounds}
    rng, est = random.Random(0), []
    for _ in range(reps):
        pick = rng.choices(rounds, k=len(rounds))
        est.append(statistics.median(t for r in pick for t in nat[r])
                   / statistics.median(t for r in pick for t in hnd[r]))
    est.sort()
    tail = int(reps * (1 - level) / 2)
    return est[tail], est[reps - 1 - tail]


def table(rows: Sequence[dict]):
    """A ``rich.table.Table``: one line per (N, size), algorithms side by side."""
    from rich.table import Table

    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    t = Table(title=f"{rows[0]['op'] if rows else ''} — time (µs), algbw and busbw (GB/s)")
    t.add_column("N", justify="right")
    t.add_column("size", justify="right")
    for a in algos:
        for what in ("µs", "algbw", "busbw"):
            t.add_column(f"{a} {what}", justify="right")
    if len(algos) > 1:
        # spaced, so rich wraps the header in its narrow column instead of cutting it ("ring/na…")
        t.add_column(f"{algos[1]} / {algos[0]} busbw", justify="right")
    cells = {(r["n"], r["bytes"], r["algorithm"]): r for r in rows}
    for n, b in sorted({(r["n"], r["bytes"]) for r in rows}):
        line = [str(n), fmt_size(b)]
        for a in algos:
            r = cells.get((n, b, a))
            line += ([f"{r['time_s'] * 1e6:.1f}", f"{r['algbw']:.3f}", f"{r['busbw']:.3f}"]
                     if r else ["–"] * 3)
        if len(algos) > 1:
            r0, r1 = cells.get((n, b, algos[0])), cells.get((n, b, algos[1]))
            line.append(f"{r1['busbw'] / r0['busbw']:.2f}" if r0 and r1 else "–")
        t.add_row(*line)
    return t


def figure(rows: Sequence[dict], reference: Optional[dict] = None):
    """A plotly ``go.Figure``: busbw (GB/s) against message size, one line per algorithm
    and N; ``reference`` (e.g. ``{"this machine's memcpy": 9.8}``) draws horizontal lines."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for (a, n) in dict.fromkeys((r["algorithm"], r["n"]) for r in rows):
        pts = sorted((r["bytes"], r["busbw"]) for r in rows if r["algorithm"] == a and r["n"] == n)
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                        name=f"{a}, N={n}", line_dash="solid" if a == "native" else "dash",
                        hovertemplate="%{x} B: %{y:.3f} GB/s<extra>%{fullData.name}</extra>")
    for label, value in (reference or {}).items():
        fig.add_hline(y=value, line_dash="dot", annotation_text=f"{label}: {value:.1f} GB/s")
    op = rows[0]["op"] if rows else ""
    fig.update_layout(title=f"{op} bus bandwidth (nccl-tests definition)", template="plotly_white",
                      xaxis=dict(title="message size S (bytes)", type="log"),
                      yaxis=dict(title="busbw (GB/s)"), height=420)
    return fig
