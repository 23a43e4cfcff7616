"""``CollectiveView``'s data: one step of a recorded collective as plain data — the two
heatmaps (each rank's inputs, and what it holds after the step), one arrow per message of
the step, kept apart where they would overlap, and the layout — from the per-step records
the ranks returned (:class:`labkit.collectives.record.Recording`).
:class:`labkit_widgets.collective_view.CollectiveView` draws it; importable from there as
before.
"""
from __future__ import annotations

from labkit.collectives.record import Recording

__all__ = ["collective_frame", "arrow_offsets", "REDUCING"]

_PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
            "#9D755D"]
_EMPTY = "—"


#: the collectives whose messages are reduced into their destination
REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def _text(cell) -> str:
    if cell is None:
        return _EMPTY
    vals = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in cell[:4]]
    return ", ".join(vals) + (", …" if len(cell) > 4 else "")


def _origin_scale(n: int) -> list:
    """A stepwise colour scale: value r (0 … n−1) gets palette colour r."""
    scale = []
    for r in range(n):
        c = _PALETTE[r % len(_PALETTE)]
        scale += [[r / n, c], [(r + 1) / n, c]]
    return scale


def arrow_offsets(segments: list, width: float = 0.7) -> list:
    """Horizontal offsets (in chunk columns) that keep vertical arrows apart.

    ``segments`` are ``(x0, y0, x1, y1)``. Arrows inside one column (``x0 == x1``) whose
    row spans overlap — 0→2 beside 1→3 in a binomial tree or recursive doubling, or the
    two directions of one exchange — would be drawn on top of each other; each gets its
    own lane, the lanes spread over ``width`` of the column. Other arrows stay centred.
    """
    out = [0.0] * len(segments)
    columns: dict = {}
    for i, (x0, y0, x1, y1) in enumerate(segments):
        if x0 == x1:
            columns.setdefault(x0, []).append(i)
    for idx in columns.values():
        lanes: list = []  # per lane: the (lo, hi) row spans already in it
        lane_of = {}
        for i in sorted(idx, key=lambda i: (min(segments[i][1], segments[i][3]),
                                            segments[i][1])):
            lo, hi = sorted((segments[i][1], segments[i][3]))
            for k, spans in enumerate(lanes):
                if all(hi <= a or lo >= b for a, b in spans):
                    spans.append((lo, hi))
                    lane_of[i] = k
                    break
            else:
                lanes.append([(lo, hi)])
                lane_of[i] = len(lanes) - 1
        if len(lanes) > 1:
            gap = width / (len(lanes) - 1)
            for i, k in lane_of.items():
                out[i] = -width / 2 + k * gap
    return out


def collective_frame(rec: Recording, step: int, transpose: bool = False) -> dict:
    """Everything drawn for ``step`` of ``rec``, as plain data (cheap to test).

    Returns ``{"inputs": {x, y, z, text}, "state": {x, y, z, text}, "annotations",
    "layout"}``: the two heatmaps (left: inputs; right: after ``step``), one arrow per
    move of the step, and the layout (title, colour axis, axis ticks, height).
    ``transpose`` draws the last step with no arrows (the all-to-all transpose view).
    """
    n, c = rec.world_size, rec.n_chunks
    step = rec.steps if transpose else max(0, min(step, rec.steps))
    a2a = rec.separate_output
    x_in, x_out = list(range(c)), [c + 1 + i for i in range(c)]
    contrib = rec.contributors(step)

    def z_of(ctb, r):
        if ctb is None:
            return None
        return ctb[0] if a2a else len(ctb)

    inputs = {"x": x_in, "y": list(range(n)),
              "z": [[(r if a2a else 1) if v is not None else None for v in rec.inputs[r]]
                    for r in range(n)],
              "text": [[_text(v) for v in rec.inputs[r]] for r in range(n)]}
    state = {"x": x_out, "y": list(range(n)),
             "z": [[z_of(contrib[r][i], r) for i in range(c)] for r in range(n)],
             "text": [[_text(v) for v in rec.snapshots[step][r]] for r in range(n)]}
    arrows = []
    moves = [m for m in ([] if transpose else rec.moves_at(step)) if m.kind != "local"]
    ends = [((x_in[m.src_chunk] if m.from_input else x_out[m.src_chunk]), x_out[m.chunk])
            for m in moves]
    shift = arrow_offsets([(ax, m.src, x, m.dst) for m, (ax, x) in zip(moves, ends)])
    for m, (ax, x), dx in zip(moves, ends, shift):
        arrows.append(dict(x=x + dx, y=m.dst, ax=ax + dx, ay=m.src, xref="x", yref="y",
                           axref="x", ayref="y", showarrow=True, arrowhead=3, arrowsize=1.3,
                           arrowwidth=2, standoff=10, startstandoff=10, text="",
                           arrowcolor="#C0392B" if m.kind == "reduce" else "#333333"))
    phase = rec.phases[step] if step < len(rec.phases) else ""
    right = "output (final)" if transpose else f"after step {step}"
    labels = [dict(x=(c - 1) / 2, y=-0.75, text="<b>inputs</b>", showarrow=False,
                   xref="x", yref="y"),
              dict(x=c + 1 + (c - 1) / 2, y=-0.75, text=f"<b>{right}</b>", showarrow=False,
                   xref="x", yref="y")]
    if a2a:
        what = ("colour = source rank · output[r][i] = input[i][r] (a transpose)"
                if transpose else "colour = source rank")
        cax = dict(colorscale=_origin_scale(n), cmin=0, cmax=n,
                   colorbar=dict(title="from rank", tickvals=[r + 0.5 for r in range(n)],
                                 ticktext=[str(r) for r in range(n)]))
    else:
        what = ("colour = ranks reduced into the chunk" if rec.op in REDUCING else
                "colour = ranks whose input the chunk holds (1: a copy)")
        cax = dict(colorscale="Blues", cmin=0, cmax=max(n, 1),
                   colorbar=dict(title="ranks in it", tickvals=list(range(1, n + 1)),
                                 ticktext=[str(k) for k in range(1, n + 1)]))
    if a2a:  # a2a z values are ranks 0 … n−1; centre each in its colour band
        inputs["z"] = [[None if v is None else v + 0.5 for v in row] for row in inputs["z"]]
        state["z"] = [[None if v is None else v + 0.5 for v in row] for row in state["z"]]
    key = ("red = reduced into the destination" if rec.op in REDUCING
           else "copies, nothing is reduced")
    title = (f"{rec.op} · {rec.algorithm} · N={n} · step {step}/{rec.steps}"
             f"{' · ' + phase if phase else ''}<br><sup>{what}; arrows: messages of this "
             f"step ({key})</sup>")
    ticks = x_in + x_out
    layout = {"title.text": title, "coloraxis": cax,
              "xaxis.tickvals": ticks, "xaxis.ticktext": [f"chunk {i}" for i in range(c)] * 2,
              "xaxis.range": [-0.6, 2 * c + 0.6],
              "yaxis.tickvals": list(range(n)), "yaxis.ticktext": [f"rank {r}" for r in range(n)],
              "yaxis.range": [n - 0.5, -1.2], "height": 190 + 46 * n}
    return {"inputs": inputs, "state": state, "annotations": labels + arrows, "layout": layout}
