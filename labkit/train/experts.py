"""Mixture-of-experts measurements of the training job: routing per step and the expert
all-to-all bytes beside the formula from the routed counts (claim C37).

Every MoE forward on this rank records its routing (:func:`labkit.models.moe.record_routing`)
tagged with the step. After training, for the step the communication metrics read, the
kept counts of every forward are all-gathered over the ``ep`` group (untraced), so each
rank knows ``C[j, e]`` — the choices rank ``j`` kept for expert ``e`` — and predicts its
own dispatch/combine bytes exactly (:func:`labkit.parallel.expert.measure.a2a_bytes_formula`);
a checkpoint policy's recomputed forward runs the count exchange, dispatch and combine once
more.
"""
from __future__ import annotations

import contextlib

import torch

from .. import comm

__all__ = ["RoutingLog", "routing_summary", "ep_predicted"]


class RoutingLog(list):
    """A :func:`record_routing` log whose entries are ``(step, RoutingStats)``."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def append(self, stats) -> None:  # the MoE layer appends; the step is the tracer's
        super().append((self.tracer.step, stats))


@contextlib.contextmanager
def recording(setup, tracer):
    """Record every MoE forward of this rank's stages while the ``with`` body runs."""
    from ..models.moe import moe_layers

    log = RoutingLog(tracer)
    layers = [m for s in setup.stages.values() for m in moe_layers(s)]
    for m in layers:
        m._log = log
    try:
        yield log
    finally:
        for m in layers:
            m._log = None


def routing_summary(log: RoutingLog, steps: int) -> list:
    """Per step ``{"counts", "kept"``: ``[layer][expert]`` choices this rank routed before /
    after dropping (summed over the step's forwards), ``"dropped"``: ``[layer]``, ``"aux"``:
    ``[layer]`` mean over the forwards ``}`` — the form :class:`labkit_widgets.ExpertView`
    reads."""
    out = []
    for s in range(steps):
        rows = [st for step, st in log if step == s]
        layers = sorted({st.layer for st in rows})
        out.append({"counts": [sum(st.counts.sum(0) for st in rows if st.layer == l).tolist()
                               for l in layers],
                    "kept": [sum(st.kept.sum(0) for st in rows if st.layer == l).tolist()
                             for l in layers],
                    "dropped": [sum(int(st.dropped.shape[0]) for st in rows if st.layer == l)
                                for l in layers],
                    "aux": [sum(float(st.aux) for st in rows if st.layer == l)
                            / max(1, sum(1 for st in rows if st.layer == l)) for l in layers]})
    return out


def ep_predicted(ctx, setup, log: RoutingLog, step: int) -> dict:
    """Bytes this rank should send over ``ep`` in ``step``: the dispatch and combine of every
    forward (and their reverse in backward) from all ranks' kept counts, plus the count
    exchange. Collective over the ``ep`` group (untraced)."""
    from ..parallel.expert.measure import a2a_bytes_formula

    cfg, mg = setup.cfg, setup.mg
    kept = [st.kept.sum(0) for s, st in log if s == step]
    mine = torch.stack(kept).to(torch.int64) if kept else torch.zeros(0, dtype=torch.int64)
    n = mg.size("ep")
    flat = torch.empty((n * mine.shape[0],) + tuple(mine.shape[1:]), dtype=torch.int64)
    enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
    try:
        comm.all_gather(flat, mine.contiguous(), group=mg.group("ep"))
    finally:
        ctx.tracer.enabled = enabled
    everyone = flat.view((n,) + tuple(mine.shape))
    elem = 2 if cfg.precision == "bf16" else 4
    me, h = mg.index("ep"), cfg.model_config.d_model
    total = 0.0
    for f in range(mine.shape[0]):
        b = a2a_bytes_formula(everyone[:, f].tolist(), me, h, elem)
        total += b["sent"]
        if cfg.checkpoint != "none":  # the recomputed forward exchanges counts and rows again
            total += b["dispatch_sent"] + b["combine_sent"] + b["counts_sent"]
    return {"all_to_all": float(total)}
