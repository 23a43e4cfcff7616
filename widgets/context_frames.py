"""The steps of a recorded context-parallel attention run, as plain data for
:class:`~.context_view.ContextParallelView`: one frame per recorded event, and what each
frame draws (who holds which chunks, the mask blocks computed so far, the work per rank).
"""
from __future__ import annotations

__all__ = ["context_frames", "context_frame", "color_scale"]

_PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
            "#9D755D"]
_ALL = "#7F7F7F"  # Ulysses: every rank computes the block, for its own heads
_KIND = {"full": "F", "diagonal": "D", "skipped": "×"}


def color_scale(cp: int) -> list:
    """Stepwise colours: value r (0 … cp−1) = rank r, value cp = all ranks."""
    cols = [_PALETTE[r % len(_PALETTE)] for r in range(cp)] + [_ALL]
    out = []
    for i, c in enumerate(cols):
        out += [[i / len(cols), c], [(i + 1) / len(cols), c]]
    return out


def context_frames(result, phase: str = "forward") -> list:
    """The steps of ``phase`` in a recorded attention run, one dict per step:
    ``{"label", "event", "ranks": {cp_rank: event}}`` where ``event`` is ``"layout"``,
    ``"compute"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``. Step 0 is the
    layout; each later step is the i-th ``cp`` region or collective of every rank.

    Raises:
        ValueError: the ranks recorded different sequences (a broken trace).
    """
    case = result.config
    name = f"cp.{case.method}.{phase}"
    per_rank = {}
    for o in result.outputs:
        if o["tp_rank"]:
            continue  # the other tensor-parallel ranks repeat the same steps
        per_rank[o["cp_rank"]] = [
            e for e in result.trace.events if e.rank == o["rank"] and (
                (e.cat == "compute" and e.name == name)
                or (e.cat == "comm" and e.axis == "cp" and e.args.get("phase") == phase))]
    lengths = {len(v) for v in per_rank.values()}
    if len(lengths) != 1:
        raise ValueError(f"ranks recorded different numbers of {phase} steps: {lengths}")
    frames = [{"label": "the split: chunks each rank holds", "event": "layout", "ranks": {}}]
    for i in range(lengths.pop()):
        evs = {r: per_rank[r][i] for r in per_rank}
        e = evs[0]
        kind = "compute" if e.cat == "compute" else e.op
        if kind == "compute" and "ring_step" in e.args:
            label = f"ring step {e.args['ring_step']}: attend the K/V block held"
        elif kind == "compute":
            label = "attend: local blocks"
        else:
            what = e.args.get("what", "")
            to = e.args.get("to")
            label = f"{kind.replace('_', '-')} of {what}" + (f" → {to}-sharded" if to else "")
        frames.append({"label": label, "event": kind, "ranks": evs})
    return frames


def _holders(frames, i: int, method: str, cp: int, chunks: tuple) -> tuple:
    """``(z, text, y labels)``: the who-holds-what grid after step ``i``."""
    n = sum(len(c) for c in chunks)
    owner = {c: r for r, cs in enumerate(chunks) for c in cs}
    if method == "ulysses":  # rows: head groups; sharded by sequence or by heads
        heads = False
        for f in frames[1:i + 1]:
            if f["event"] == "all_to_all":
                heads = f["ranks"][0].args.get("to") == "heads"
        z = [[g if heads else owner[c] for c in range(n)] for g in range(cp)]
        text = [["" for _ in range(n)] for _ in range(cp)]
        return z, text, [f"heads {g}" for g in range(cp)]
    z = [[owner[c] if c in chunks[r] else None for c in range(n)] for r in range(cp)]
    text = [["Q" if c in chunks[r] else "" for c in range(n)] for r in range(cp)]
    held = {r: chunks[r] for r in range(cp)}
    for f in frames[1:i + 1]:
        for r, e in f["ranks"].items():
            if f["event"] == "compute" and "kv_origin" in e.args:
                held[r] = chunks[e.args["kv_origin"]]
            elif f["event"] in ("all_gather", "compute"):
                held[r] = tuple(range(n))
            elif f["event"] == "reduce_scatter":
                held[r] = chunks[r]
    for r in range(cp):
        for c in range(n):
            z[r][c] = owner[c] if c in held[r] else None
            text[r][c] = ("Q " if c in chunks[r] else "") + ("K/V" if c in held[r] else "")
    return z, text, [f"rank {r}" for r in range(cp)]


def context_frame(frames, i: int, method: str, cp: int, chunks: tuple,
                  closed_form: list) -> dict:
    """Everything drawn for step ``i`` (pure data): ``{"holders", "mask", "work",
    "formula", "title"}`` — two heatmaps' ``x, y, z, text``, the bars and markers."""
    n = sum(len(c) for c in chunks)
    z, text, rows = _holders(frames, i, method, cp, chunks)
    mz = [[None] * n for _ in range(n)]
    mt = [[""] * n for _ in range(n)]
    work = [0] * cp
    for f in frames[1:i + 1]:
        if f["event"] != "compute":
            continue
        for r, e in f["ranks"].items():
            work[r] += e.args["pairs"]
            for qc, kc, kind, _pairs in e.args["blocks"]:
                mt[qc][kc] = _KIND[kind]
                if kind != "skipped":
                    mz[qc][kc] = cp if method == "ulysses" else r
    chunk_names = [f"c{c}" for c in range(n)]
    return {"holders": {"x": chunk_names, "y": rows, "z": z, "text": text},
            "mask": {"x": chunk_names, "y": chunk_names, "z": mz, "text": mt},
            "work": {"x": [f"rank {r}" for r in range(cp)], "y": work},
            "formula": {"x": [f"rank {r}" for r in range(cp)], "y": list(closed_form)},
            "title": f"step {i}/{len(frames) - 1}: {frames[i]['label']}"}
