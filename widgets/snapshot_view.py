"""Snapshots of the training state (:mod:`labkit.snapshot`), drawn from what the ranks
reported.

* :func:`reshard_figure` — a resumed run's resharding: each file of the snapshot (written
  by one rank of the saving layout) on the left, each rank of the loading layout on the
  right, a band per (file, rank) as wide as the bytes that rank read from that file.
* :func:`resume_losses_figure` — an uninterrupted run's losses with the interrupted run's
  and the resumed run's drawn over them (the resume starting where the save was).
* :func:`snapshot_table` — bytes written and read, seconds, per rank (HTML).

Everything comes from ``RunResult.metrics[r]["snapshot"]`` (``saved``: the rank's file and
bytes; ``loaded``: ``reads`` ``{file: bytes}``, ``bytes_read``, ``seconds``).
"""
from __future__ import annotations

import re
from typing import Optional

import plotly.graph_objects as go

from . import _style as S

__all__ = ["reshard_figure", "resume_losses_figure", "snapshot_table", "reshard_links"]

_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def reshard_links(result) -> list:
    """``[(saved rank, new rank, bytes)]`` read by a resumed run, from its metrics.

    Raises:
        ValueError: ``result`` did not resume from a snapshot.
    """
    links = []
    for r, m in enumerate(result.metrics):
        loaded = m.get("snapshot", {}).get("loaded")
        if loaded is None:
            raise ValueError(f"rank {r} of this run loaded no snapshot (RunConfig.resume)")
        for f, b in sorted(loaded["reads"].items()):
            hit = _FILE.fullmatch(f)
            links.append((int(hit.group(1)) if hit else f, r, b))
    return links


def _layout_name(layout: Optional[dict]) -> str:
    if not layout:
        return "?"
    p = {k: v for k, v in layout["parallel"].items() if v > 1} or {"dp": 1}
    s = "×".join(f"{k}{v}" for k, v in p.items())
    if layout.get("zero_stage"):
        s += f" ZeRO-{layout['zero_stage']}"
    return s


def reshard_figure(result, height: int = 320) -> go.Figure:
    """Sankey of a resumed run: saved rank files → loading ranks, band width = bytes read
    (whole stored chunks; the boxes a rank needs are narrowed from them)."""
    links = reshard_links(result)
    first = result.metrics[0]["snapshot"]["loaded"]
    saved = sorted({s for s, _, _ in links}, key=str)
    new = list(range(len(result.metrics)))
    labels = [f"saved rank {s}" for s in saved] + [f"rank {r}" for r in new]
    idx = {s: i for i, s in enumerate(saved)}
    colors = [S.COMPUTE_COLORS["forward"]] * len(saved) + [S.COMPUTE_COLORS["optimizer"]] * len(new)
    now = {k: v for k, v in result.config.parallel.__dict__.items() if v > 1} or {"dp": 1}
    title = (f"resharding: saved as {_layout_name(first.get('saved_layout'))} → loaded as "
             + "×".join(f"{k}{v}" for k, v in now.items())
             + (f" ZeRO-{result.config.zero_stage}" if result.config.zero_stage else ""))
    fig = go.Figure(go.Sankey(
        arrangement="fixed",
        node=dict(label=labels, color=colors, pad=12, thickness=14),
        link=dict(source=[idx[s] for s, _, _ in links],
                  target=[len(saved) + r for _, r, _ in links],
                  value=[b for _, _, b in links],
                  customdata=[S.fmt_bytes(b) for _, _, b in links],
                  hovertemplate="%{source.label} → %{target.label}: %{customdata}"
                                "<extra></extra>")))
    fig.update_layout(title=dict(text=title, font=dict(size=14)), height=height,
                      margin=dict(l=10, r=10, t=40, b=10))
    return fig


def resume_losses_figure(full, saved, resumed, extra: Optional[dict] = None) -> go.Figure:
    """The uninterrupted run's loss per step, the saving run's steps and the resumed run's
    (``extra``: more resumed runs by label) drawn over it."""
    fig = go.Figure()
    fig.add_scatter(x=list(range(len(full.losses))), y=full.losses, mode="lines",
                    name="uninterrupted", line=dict(color="#BBBBBB", width=6))
    fig.add_scatter(x=list(range(len(saved.losses))), y=saved.losses, mode="markers",
                    name="before the save", marker=dict(symbol="circle", size=9,
                                                         color=S.COMPUTE_COLORS["forward"]))
    runs = {"resumed": resumed, **(extra or {})}
    symbols = ["x", "cross", "diamond", "triangle-up"]
    for i, (label, r) in enumerate(runs.items()):
        start = r.metrics[0].get("first_step", 0)
        fig.add_scatter(x=list(range(start, start + len(r.losses))), y=r.losses,
                        mode="markers", name=label,
                        marker=dict(symbol=symbols[i % len(symbols)], size=10))
    fig.update_layout(title="loss: interrupted + resumed over the uninterrupted run",
                      xaxis_title="step", yaxis_title="loss (nats)", height=320,
                      margin=dict(l=50, r=10, t=40, b=40))
    return fig


def snapshot_table(result) -> str:
    """Per rank: the snapshot file it wrote, bytes and seconds; the bytes it read, from how
    many files, and seconds (HTML)."""
    rows = []
    for r, m in enumerate(result.metrics):
        snap = m.get("snapshot", {})
        row = {"rank": r}
        if snap.get("saved"):
            s = snap["saved"][-1]
            row.update(file=s["file"] or "–", written=S.fmt_bytes(s["bytes_written"]),
                       save_s=f"{s['seconds']:.3f}")
        if snap.get("loaded"):
            x = snap["loaded"]
            row.update(read=S.fmt_bytes(x["bytes_read"]), files=len(x["reads"]),
                       load_s=f"{x['seconds']:.3f}")
        rows.append(row)
    cols = [(k, k, str) for k in ("rank", "file", "written", "save_s", "read", "files",
                                  "load_s") if any(k in row for row in rows)]
    for row in rows:
        for k, _, _ in cols:
            row.setdefault(k, "–")
    return S.table_html(rows, cols, highlight_last=False)
