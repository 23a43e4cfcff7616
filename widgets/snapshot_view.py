"""Snapshots of the training state (:mod:`labkit.snapshot`), drawn from what the ranks
reported.

* :func:`reshard_figure` — a resumed run's resharding: each file of the snapshot (written
  by one rank of the saving layout) on the left, each rank of the loading layout on the
  right, a band per (file, rank) as wide as the bytes that rank read from that file.
* :func:`resume_losses_figure` — an uninterrupted run's losses with the interrupted run's
  and the resumed run's drawn over them (the resume starting where the save was).
* :func:`snapshot_table` — a resumed run's load per new rank (the saved ranks it read,
  bytes, elements kept, seconds), or a run's save per rank (HTML).

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


def _run_label(result) -> str:
    """``"dp2×tp2 ZeRO-1, 4 ranks"``: a run's layout, from its config."""
    now = {k: v for k, v in result.config.parallel.__dict__.items() if v > 1} or {"dp": 1}
    z = f" ZeRO-{result.config.zero_stage}" if result.config.zero_stage else ""
    return "×".join(f"{k}{v}" for k, v in now.items()) + z + f", {len(result.metrics)} ranks"


def resume_losses_figure(full, saved, resumed, extra: Optional[dict] = None) -> go.Figure:
    """The uninterrupted run's loss per step, the saving run's steps and the resumed run's
    (``extra``: more resumed runs by label) drawn over it.

    Each resumed run is named by its layout (``"resumed on dp2×tp2 ZeRO-1, 4 ranks"``) unless
    ``extra`` names it. Resumed runs agree to ~1e-7, so their markers would coincide: each is
    drawn a fixed fraction of a step to the side of the others (dodged, as a grouped bar
    chart is), its hover giving the true step."""
    fig = go.Figure()
    fig.add_scatter(x=list(range(len(full.losses))), y=full.losses, mode="lines",
                    name="uninterrupted", line=dict(color="#BBBBBB", width=6))
    fig.add_scatter(x=list(range(len(saved.losses))), y=saved.losses, mode="markers",
                    name="before the save", marker=dict(symbol="circle", size=9,
                                                         color=S.COMPUTE_COLORS["forward"]))
    runs = {f"resumed on {_run_label(resumed)}": resumed, **(extra or {})}
    symbols = ["x", "diamond", "triangle-up", "square"]
    dodge = 0.15
    for i, (label, r) in enumerate(runs.items()):
        start = r.metrics[0].get("first_step", 0)
        steps = list(range(start, start + len(r.losses)))
        off = (i - (len(runs) - 1) / 2) * dodge
        fig.add_scatter(x=[s + off for s in steps], y=r.losses, customdata=steps,
                        mode="markers", name=label,
                        hovertemplate="step %{customdata}: loss %{y:.6f}<extra>%{fullData.name}"
                                      "</extra>",
                        marker=dict(symbol=symbols[i % len(symbols)], size=10))
    fig.update_layout(title="loss: interrupted + resumed over the uninterrupted run",
                      xaxis_title="step (resumed runs drawn side by side)",
                      yaxis_title="loss (nats)", height=340,
                      margin=dict(l=50, r=10, t=40, b=40))
    return fig


def snapshot_table(result, side: Optional[str] = None) -> str:
    """A resumed run's load (``side="load"``, the default for a run that resumed): per new
    rank, the saved ranks whose files it read, the bytes read, the elements it keeps and
    seconds. ``side="save"`` (the default otherwise): per rank, the file it wrote in its
    latest save, bytes and seconds. HTML.

    Raises:
        ValueError: ``side`` is not ``"load"``, ``"save"`` or ``None``, or names a side the
            run did not do.
    """
    loaded = any(m.get("snapshot", {}).get("loaded") for m in result.metrics)
    side = side or ("load" if loaded else "save")
    if side not in ("load", "save"):
        raise ValueError(f"side must be 'load' or 'save', got {side!r}")
    rows = []
    for r, m in enumerate(result.metrics):
        snap = m.get("snapshot", {})
        if side == "save" and snap.get("saved"):
            s = snap["saved"][-1]
            rows.append({"rank": r, "file": s["file"] or "–", "step": s["step"],
                         "written": S.fmt_bytes(s["bytes_written"]),
                         "seconds": f"{s['seconds']:.3f}"})
        elif side == "load" and snap.get("loaded"):
            x = snap["loaded"]
            saved = sorted(int(h.group(1)) for f in x["reads"] if (h := _FILE.fullmatch(f)))
            rows.append({"rank": r, "from": ", ".join(map(str, saved)),
                         "read": S.fmt_bytes(x["bytes_read"]),
                         "kept": f"{x['elements_needed']:,}",
                         "seconds": f"{x['seconds']:.3f}"})
        else:
            raise ValueError(f"rank {r} of this run has no snapshot {side} to show")
    if side == "save":
        cols = [("rank", "rank", str), ("file written", "file", str),
                ("after step", "step", str), ("bytes", "written", str),
                ("save s", "seconds", str)]
    else:
        cols = [("new rank", "rank", str), ("read the files of saved ranks", "from", str),
                ("bytes read", "read", str), ("elements kept", "kept", str),
                ("load s", "seconds", str)]
    return S.table_html(rows, cols, highlight_last=False)
