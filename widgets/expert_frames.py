"""``ExpertView``'s data: where a mixture-of-experts run's tokens went, as plain data — the
ranks whose routing is distinct, the choices each routed to each expert and kept (per layer
or summed over layers) with the imbalance, and the step's token all-to-alls as traffic
matrices in the order they ran — from a :func:`labkit.train.run` result
(``outputs[r]["routing"]`` and the trace). :class:`labkit_widgets.expert_view.ExpertView`
draws them; importable from there as before.
"""
from __future__ import annotations

from collections import defaultdict

from labkit.parallel.expert.measure import imbalance

__all__ = ["ALL", "routing_ranks", "expert_load", "a2a_frames"]

#: the layer selector's value for the sum over layers
ALL = "all layers"


def routing_ranks(result) -> list:
    """The ranks whose routing is distinct: every rank of tensor-parallel position 0 (the
    ``tp`` ranks of a group route the same tokens).

    Raises:
        ValueError: not a mixture-of-experts training run, or a pipeline run (``pp > 1``:
            a rank's routing lists hold only its own stage's layers).
    """
    cfg = result.config
    if not (isinstance(result.outputs[0], dict) and "routing" in result.outputs[0]):
        raise ValueError("ExpertView shows a training run of a mixture-of-experts model "
                         "(outputs[r]['routing']): run labkit.train.run with e.g. 'tiny-moe'")
    if cfg.parallel.pp > 1:
        raise ValueError(f"ExpertView draws runs with pp=1 (every rank routes every layer), "
                         f"got pp={cfg.parallel.pp}")
    mesh = cfg.mesh
    return [r for r in range(len(result.outputs)) if mesh.coords(r)["tp"] == 0]


def expert_load(result, step: int, layer=ALL) -> dict:
    """The left heatmap as plain data for ``step`` and ``layer`` (an index or :data:`ALL`,
    the sum over layers): ``{"ranks", "z": [row][expert]`` kept choices, ``"text"``,
    ``"dropped": [row]``, ``"totals": [expert]``, ``"imbalance"}`` (max/mean of the totals;
    rows are :func:`routing_ranks`)."""
    ranks = routing_ranks(result)
    n_layers = len(result.outputs[ranks[0]]["routing"][step]["kept"])
    layers = range(n_layers) if layer == ALL else [int(layer)]
    z, text, dropped = [], [], []
    for r in ranks:
        rec = result.outputs[r]["routing"][step]
        row = [sum(rec["kept"][li][e] for li in layers) for e in range(len(rec["kept"][0]))]
        wanted = [sum(rec["counts"][li][e] for li in layers) for e in range(len(row))]
        z.append(row)
        text.append([f"{k}" + (f" (−{w - k})" if w > k else "") for k, w in zip(row, wanted)])
        dropped.append(sum(rec["dropped"][li] for li in layers))
    totals = [sum(col) for col in zip(*z)]
    return {"ranks": ranks, "z": z, "text": text, "dropped": dropped, "totals": totals,
            "imbalance": imbalance(totals)}


def a2a_frames(trace, step: int) -> list:
    """The step's token all-to-alls (dispatch/combine; forward, backward, recompute) in the
    order they ran: ``[{"layer", "phase", "pass", "micro", "ranks", "matrix" [i][j] bytes
    ranks[i] → ranks[j], "sent", "start"}]``.

    Each rank records its part of each all-to-all; within one ``ep`` group the ``n``-th
    event of a rank pairs with the ``n``-th of every other member (a group runs its
    collectives in one order). Calls with the same ``(layer, phase, pass)`` and occurrence
    (``micro``: the microbatch) in different ``ep`` groups ran side by side and share a
    frame, as blocks of one matrix over every rank that took part.
    """
    per_group: dict = defaultdict(lambda: defaultdict(list))
    for ev in trace.events:  # sorted by start time
        if (ev.op == "all_to_all" and ev.step == step
                and ev.args.get("phase") in ("dispatch", "combine")):
            per_group[tuple(ev.peers)][ev.rank].append(ev)
    calls_by_key: dict = defaultdict(list)
    for peers, by_rank in per_group.items():
        seen: dict = defaultdict(int)
        for calls in zip(*(by_rank[r] for r in peers if r in by_rank)):
            a = calls[0].args
            kind = (a.get("layer"), a["phase"], a.get("pass", "forward"))
            calls_by_key[kind + (seen[kind],)].append((peers, calls))
            seen[kind] += 1
    ranks = sorted({r for peers in per_group for r in peers})
    frames = []
    for (layer, phase, pss, micro), groups in calls_by_key.items():
        matrix = [[0.0] * len(ranks) for _ in ranks]
        for peers, calls in groups:
            for ev in calls:
                row = matrix[ranks.index(ev.rank)]
                for j, b in zip(peers, ev.args["bytes_to"]):
                    row[ranks.index(j)] = float(b)
        frames.append({"layer": layer, "phase": phase, "pass": pss, "micro": micro,
                       "ranks": ranks, "matrix": matrix, "sent": sum(map(sum, matrix)),
                       "start": min(ev.start for _, calls in groups for ev in calls)})
    frames.sort(key=lambda f: f["start"])
    return frames
