"""How much of a step's data-parallel all-gather time compute hid, from one rank's trace:
``metrics["overlap"]`` of a ZeRO-3 job, notebook 03's prefetch comparison, and the "AG
hidden" column of ``labkit run``'s report (:func:`labkit.cli.report.ag_hidden`)."""
from __future__ import annotations

__all__ = ["DP_AXES", "overlap_fraction"]

#: the mesh axes (and views, :data:`labkit.mesh.VIEWS`) of data-parallel communication: an
#: event whose ``axis`` is one of these is the data-parallel wrappers' (labkit's label all
#: their calls ``"dp"``, HSDP's shard and replicate dims in ``args["mesh_dim"]``)
DP_AXES = ("dp", "dp_shard", "dp_replicate", "dp_cp", "fsdp")


def overlap_fraction(events, step: int, rank=None) -> dict:
    """Fraction of the data-parallel parameter all-gathers' time hidden under compute in
    ``step``, from the trace: labkit's ZeRO-3/FSDP (and HSDP) unit all-gathers.

    Covers exactly the events of ``step`` (on ``rank``, or all ranks when ``None``) that are

    * calls: ``op == "all_gather"``, ``axis`` in :data:`DP_AXES`, ``args["phase"]``
      ``"forward"`` or ``"backward"``, and ``bytes_sent > 0`` (a one-rank shard group's
      "all-gathers" move nothing and hide nothing); a call's span runs from issue to the
      return of its ``wait``;
    * blocked time: ``cat == "wait"`` events with ``axis`` in :data:`DP_AXES`, the time the
      compute thread sat issuing or waiting on one of those all-gathers
      (:mod:`labkit.parallel.zero.fsdp`).

    Not covered: tensor- and sequence-parallel all-gathers (axis ``"tp"``, asynchronous too,
    with their own phases), context-parallel ones (``"cp"``), the gradient reduce-scatters,
    HSDP's replica all-reduces, DDP's bucket all-reduces, and PyTorch's FSDP2 (its
    collectives are not traced).

    Hidden = span − blocked, so per phase the fraction is ``1 − blocked / span``, clipped
    to [0, 1]. Returns ``{"forward", "backward", "total"}`` (fractions; ``None`` where no
    such all-gather moved bytes). ``"total"`` counts the forward and backward calls and
    every blocked span on them (also those waited for at a reshard or a recomputation).
    """
    ours = [e for e in events if e.step == step and e.axis in DP_AXES
            and (rank is None or e.rank == rank)]
    out = {}
    for phase in ("forward", "backward", None):
        ag = sum(e.duration for e in ours if e.op == "all_gather" and e.cat == "comm"
                 and e.bytes_sent > 0
                 and e.args.get("phase") in ((phase,) if phase else ("forward", "backward")))
        wait = sum(e.duration for e in ours if e.cat == "wait"
                   and (phase is None or e.args.get("phase") == phase))
        out[phase or "total"] = (min(1.0, max(0.0, 1.0 - wait / ag)) if ag > 0 else None)
    return out
