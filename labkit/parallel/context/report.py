"""Reports of context-parallel runs: every measured number beside its formula.

:func:`attention_report` reads a :func:`.jobs.attention_job` run (outputs and trace) and
returns plain data: per rank the attention work from its own counter and the closed form,
the imbalance, bytes per phase from the trace and the formula, the K/V working set, and for
the ring the fraction of send/recv time hidden under block compute. :func:`model_report`
does the same for a :func:`.jobs.model_job` run's activation memory.
"""
from __future__ import annotations

from .layout import imbalance
from .measure import (activation_formula, bytes_formula, kv_working_set_formula, ring_overlap,
                      trace_bytes, work_closed_form)

__all__ = ["attention_report", "model_report"]


def _degrees(case, n_outputs: int) -> tuple:
    if case.mesh is not None:
        return case.mesh.cp, case.mesh.tp
    return case.cp or n_outputs, 1


def attention_report(result) -> dict:
    """Everything measured in one attention run (``result`` from
    ``jobs.run(cluster, AttentionCase(...))``), each beside its formula.

    Returns a dict with, per rank (lists in rank order): ``work`` and ``work_formula``
    (forward pairs × batch × heads), ``bytes`` and ``bytes_formula`` (``{"forward",
    "backward"}`` sent, bytes), ``kv_bytes`` and ``kv_formula`` (``{"forward", "backward"}``),
    ``overlap`` (ring only: fraction 0–1 of send/recv time under block compute, per phase);
    and ``imbalance`` (max/mean of ``work``), ``imbalance_formula``, ``method``, ``cp``.
    """
    case, outs = result.config, result.outputs
    cp, tp = _degrees(case, len(outs))
    heads, kvh = case.n_heads // tp, case.n_kv_heads // tp
    shape = dict(batch=case.batch, kv_heads=kvh, seq_len=case.seq_len, head_dim=case.head_dim)
    b_formula = bytes_formula(case.method, cp, heads=heads, **shape)
    kv_formula = kv_working_set_formula(case.method, cp, **shape)
    rep = {"method": case.method, "cp": cp, "tp": tp, "zigzag": case.zigzag,
           "causal": case.causal, "work": [], "work_formula": [], "bytes": [],
           "bytes_formula": [], "kv_bytes": [], "kv_formula": [], "overlap": []}
    for o in outs:
        rep["work"].append(o["work"]["pairs"]["forward"])
        rep["work_formula"].append(work_closed_form(case.method, o["cp_rank"], cp, case.seq_len,
                                                    case.zigzag, case.causal, case.batch,
                                                    heads))
        rep["bytes"].append({ph: trace_bytes(result.trace, o["rank"], ph)
                             for ph in ("forward", "backward")})
        rep["bytes_formula"].append({k: b_formula[k] for k in ("forward", "backward")})
        rep["kv_bytes"].append(dict(o["work"]["kv_bytes"]))
        rep["kv_formula"].append(dict(kv_formula))
        if case.method == "ring":
            rep["overlap"].append({ph: ring_overlap(result.trace, o["rank"], ph)
                                   for ph in ("forward", "backward")})
    rep["imbalance"] = imbalance(rep["work"])
    rep["imbalance_formula"] = imbalance(rep["work_formula"])
    return rep


def model_report(result, single_rank_bytes: int) -> dict:
    """Activation memory of a ``jobs.run(cluster, ModelCase(...))`` run per rank beside
    :func:`.measure.activation_formula` from ``single_rank_bytes`` (what
    ``reference_model(case, blockwise=True)`` saved): ``{"saved", "formula",
    "single_rank", "ratio"}`` with ``ratio`` = saved / single-rank per rank."""
    case, outs = result.config, result.outputs
    cp, m = case.cp or len(outs), case.model
    formula = activation_formula(case.method, cp, single_rank_bytes, n_layers=m.n_layers,
                                 batch=case.batch, kv_heads=m.kv_heads, seq_len=m.seq_len,
                                 head_dim=m.head_dim, heads=m.n_heads)
    saved = [o["saved_bytes"] for o in outs]
    return {"method": case.method, "cp": cp, "saved": saved, "formula": formula,
            "single_rank": single_rank_bytes,
            "ratio": [s / single_rank_bytes for s in saved]}
