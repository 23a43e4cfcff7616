"""The merged, cross-rank :class:`Trace` and its queries: bytes moved, busy time,
communication hidden behind computation, instrumented steps, Chrome export.

Events come from each rank's :class:`labkit.trace.Tracer` (:mod:`labkit.trace_event`).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Iterable, Optional

from labkit.trace_event import COMM, COMPUTE, MARK, P2P, Event

__all__ = ["Trace"]


class Trace:
    """The events of all ranks of one run, merged and sorted by start time.

    Times are kept on the shared clock; ``t0`` is the earliest start, and exports shift to
    it so a timeline starts at zero.
    """

    def __init__(self, events: Iterable[Event] = ()):
        self.events: list[Event] = sorted(events, key=lambda e: (e.start, e.rank))
        self.t0 = self.events[0].start if self.events else 0.0

    @classmethod
    def merge(cls, per_rank: Iterable[Iterable[Event]]) -> "Trace":
        return cls(e for events in per_rank for e in events)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def filter(self, rank=None, cat=None, op=None, step=None, name=None) -> list[Event]:
        """Events matching every argument that is not ``None``."""
        return [e for e in self.events
                if (rank is None or e.rank == rank) and (cat is None or e.cat == cat)
                and (op is None or e.op == op) and (step is None or e.step == step)
                and (name is None or e.name == name)]

    def instrumented_steps(self) -> dict:
        """``{step: what}`` for the steps flagged as instrumented (see :func:`flag_step`):
        any event whose ``args`` has ``"instrumented"`` flags its step."""
        out: dict = {}
        for e in self.events:
            what = (e.args or {}).get("instrumented")
            if what and e.step >= 0:
                out.setdefault(e.step, str(what))
        return out

    def comm_bytes(self, rank: int, op=None, step=None, direction: str = "sent") -> float:
        """Bytes ``rank`` sent (or received) through labkit.comm, optionally per op/step."""
        key = "bytes_sent" if direction == "sent" else "bytes_recv"
        return sum(getattr(e, key) for e in self.events
                   if e.rank == rank and e.cat in (COMM, P2P)
                   and (op is None or e.op == op) and (step is None or e.step == step))

    def busy_time(self, rank: int, cat: str = COMPUTE, step=None) -> float:
        """Seconds of ``cat`` spans on ``rank``, overlaps merged (nested regions count once)."""
        spans = sorted((e.start, e.end) for e in self.filter(rank=rank, cat=cat, step=step))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + ((cur_e - cur_s) if cur_e is not None else 0.0)

    def overlap_fraction(self, rank: int, op: str = "all_reduce",
                         under: tuple = ("backward",), step=None, axis=None) -> float:
        """Fraction (0–1) of ``rank``'s ``op`` time that ran while a compute region named in
        ``under`` was open: communication hidden behind computation. 0 when there is no
        ``op`` time.

        ``axis`` (a mesh axis name, or a tuple of names) keeps only the calls on it: in a
        composition the same op runs on several axes (data-parallel bucket all-reduces
        beside tensor-parallel ones), and ``None`` counts them all.

        For async ops the span runs from issue to ``wait()``, so this measures how much of
        the in-flight window the computation covered (on gloo the transfer itself runs on
        a background thread in that window).
        """
        axes = (axis,) if isinstance(axis, str) else axis
        comm = [(e.start, e.end) for e in self.filter(rank=rank, op=op, step=step)
                if axes is None or e.axis in axes]
        busy = [(e.start, e.end) for e in self.filter(rank=rank, cat=COMPUTE, step=step)
                if e.name in under]
        total = sum(e - s for s, e in comm)
        if total <= 0:
            return 0.0
        hidden = sum(max(0.0, min(ce, be) - max(cs, bs)) for cs, ce in comm for bs, be in busy)
        return min(1.0, hidden / total)

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]

    def to_chrome(self, path: Optional[str] = None) -> dict:
        """Chrome trace-event JSON (Perfetto, chrome://tracing): one track per rank, every
        time in µs from ``t0`` (see :func:`labkit.trace_chrome.to_chrome`).

        Returns the JSON object; writes it to ``path`` when given.
        """
        from .trace_chrome import to_chrome

        return to_chrome(self, path)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        span = (max(e.end for e in self.events) - self.t0) if self.events else 0.0
        # the timeline draws the spans; a Chrome trace adds a name entry per track
        marks = sum(e.cat == MARK for e in self.events)
        return (f"Trace({len(self.events)} events: {len(self.events) - marks} spans + {marks} "
                f"marks, ranks={self.ranks}, span={span:.3f} s)")
