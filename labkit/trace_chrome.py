"""A :class:`labkit.trace.Trace` as Chrome trace-event JSON (Perfetto, chrome://tracing).

One process track per rank, with two threads: ``compute`` (tid 0) and ``communication``
(tid 1), so a bucket all-reduce running under backward shows as overlap. Spans are complete
events (``"ph": "X"``), marks (:func:`labkit.trace.flag_step`) instant events (``"ph": "i"``).

Every time in the file is in microseconds from the same origin, the trace's ``t0`` (its
earliest start): an event's ``ts`` and ``dur``, and the clock readings an event carries in
``args`` (:data:`CLOCK_ARGS`: an asynchronous call's ``done``, when the backend finished it,
and ``waited``, when its caller began to wait; see :meth:`labkit.comm_handle.Handle.note_done`).
So ``args.done - ts`` is the call's time from issue to completion, in µs. In memory these are
seconds on the shared clock (``time.perf_counter``); the export converts them with one
expression, ``(t - t0) * 1e6``, so a reader can recompute every field exactly.
"""
from __future__ import annotations

import json
from typing import Optional

__all__ = ["to_chrome", "CLOCK_ARGS", "chrome_time"]

#: ``Event.args`` keys that hold a reading of the trace clock (seconds), exported like ``ts``
CLOCK_ARGS = ("done", "waited")


def chrome_time(t: float, t0: float) -> float:
    """Seconds ``t`` on the trace clock as the file's time: µs after ``t0``."""
    return (t - t0) * 1e6


def to_chrome(trace, path: Optional[str] = None) -> dict:
    """``trace`` (a :class:`labkit.trace.Trace`) as a Chrome trace document.

    Each span's ``args`` hold its ``step``, its own ``args`` (values that are not JSON
    scalars as ``str``; :data:`CLOCK_ARGS` in µs from ``t0``, ``None`` kept) and, for a
    communication call, ``op``, ``bytes_sent``, ``bytes_recv`` (algorithmic bytes),
    ``axis`` and ``peers``.

    Returns the JSON object (``{"traceEvents": [...], "displayTimeUnit": "ms"}``); writes it
    to ``path`` when given.
    """
    from .trace_event import COMPUTE, MARK

    out = []
    for r in trace.ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                    "args": {"name": f"rank {r}"}})
        for tid, label in ((0, "compute"), (1, "communication")):
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                        "args": {"name": label}})
    t0 = trace.t0
    for e in trace.events:
        args = {"step": e.step}
        for k, v in e.args.items():
            clock = k in CLOCK_ARGS and isinstance(v, (int, float)) and not isinstance(v, bool)
            args[k] = chrome_time(v, t0) if clock else _jsonable(v)
        if e.cat == MARK:  # an instant event on the rank's compute thread
            out.append({"ph": "i", "s": "t", "name": e.name, "cat": e.cat, "pid": e.rank,
                        "tid": 0, "ts": chrome_time(e.start, t0), "args": args})
            continue
        if e.op:
            args.update(op=e.op, bytes_sent=e.bytes_sent, bytes_recv=e.bytes_recv,
                        axis=e.axis, peers=list(e.peers))
        out.append({"ph": "X", "name": e.name, "cat": e.cat, "pid": e.rank,
                    "tid": 0 if e.cat == COMPUTE else 1, "ts": chrome_time(e.start, t0),
                    "dur": max(e.duration, 0.0) * 1e6, "args": args})
    doc = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(doc, f)
    return doc


def _jsonable(v):
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
