"""One recorded span (:class:`Event`), the event categories, and the tuple packing ranks
send their events in.

:mod:`labkit.trace` records these on each rank; :class:`labkit.trace_merged.Trace` merges
and queries them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

__all__ = ["Event", "pack_events", "unpack_events", "COMPUTE", "COMM", "P2P", "MARK"]

COMPUTE, COMM, P2P = "compute", "comm", "p2p"
#: zero-length annotations (e.g. "this step is instrumented"), not spans of work
MARK = "mark"


@dataclass
class Event:
    """One span on one rank.

    Attributes:
        rank: the global rank that recorded it.
        name: what ran, e.g. ``"forward"``, ``"layers.1.backward"``, ``"all_reduce"``.
        cat: ``"compute"``, ``"comm"`` (collective), ``"p2p"`` (send/recv) or ``"mark"``
            (a zero-length annotation, see :func:`flag_step`).
        start, end: seconds on the shared clock.
        step: training step the event belongs to (-1 outside a step).
        op: collective or point-to-point op (``"all_reduce"``, ``"send"`` …).
        bytes_sent, bytes_recv: algorithmic bytes this rank moved (ring formulas; see
            :mod:`labkit.comm` for why these are not gloo's wire bytes).
        axis: mesh axis of the group (``"dp"``, ``"tp"`` …) or ``None``.
        peers: global ranks of the group (collectives) or the other end (p2p).
        args: anything else worth showing (bucket id, dtype, numel, async …).
    """

    rank: int
    name: str
    cat: str
    start: float
    end: float
    step: int = -1
    op: Optional[str] = None
    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    axis: Optional[str] = None
    peers: tuple = ()
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.end - self.start


def pack_events(events: Iterable[Event]) -> list:
    """``events`` as plain tuples in :class:`Event`'s field order, for sending between
    processes: pickling tuples costs about half of pickling the dataclasses (a warm rank
    sends a few hundred events after every job)."""
    return [(e.rank, e.name, e.cat, e.start, e.end, e.step, e.op, e.bytes_sent, e.bytes_recv,
             e.axis, e.peers, e.args) for e in events]


def unpack_events(rows: Iterable[tuple]) -> list:
    """The :class:`Event` objects :func:`pack_events` packed."""
    return [Event(*row) for row in rows]
