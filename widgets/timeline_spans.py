"""What the timeline draws for a communication call: the span of a call left in flight (the
time its backend reported it finished, or the part its caller waited for, instead of issue
to ``wait()``), and a bar's label and hover lines (the place the call tagged, its group or
peer, its issue/finish/wait times). :mod:`labkit_widgets.timeline_traces` builds the bars
with them; importable from there as before.
"""
from __future__ import annotations

from labkit.trace import COMPUTE

from . import _style as S

__all__ = ["BLOCKED_CATS"]

#: trace-event categories drawn as "blocked" (the compute thread waiting on a collective)
BLOCKED_CATS = ("wait",)


def _where(e) -> tuple:
    """A comm bar's label and hover line from the place its call tagged: ``("L3",
    "<br>layer 3 · mlp_out · forward")``, or the site alone outside the blocks (``"emb"``
    for ``emb_out``); ``("", "")`` for an untagged call."""
    a = e.args or {}
    layer, site = a.get("layer"), a.get("site")
    if layer is None and site is None:
        return "", ""
    label = f"L{layer}" if layer is not None else str(site).split("_")[0]
    parts = ([f"layer {layer}"] if layer is not None else []) + \
        [str(a[k]) for k in ("site", "phase") if a.get(k)]
    return label, "<br>" + " · ".join(parts)


def _group(e) -> str:
    """A comm bar's group line: ``"group [0, 1]"`` (a collective's ranks), ``"to rank 2"`` /
    ``"from rank 2"`` (a send's or a receive's peer), ``"group –"`` when not recorded."""
    peers = list(e.peers or ())
    if S.comm_family(e.op) == "p2p" and len(peers) == 1:
        return f"{'from' if 'recv' in (e.op or '') else 'to'} rank {peers[0]}"
    return f"group {peers}" if peers else "group –"


def _ms(trace, t) -> float:
    return (t - trace.t0) * 1e3


def _drawn_spans(trace, events) -> dict:
    """``{id(event): (start_s, end_s, note)}``: what a communication bar draws, for the
    calls left in flight (``args["async"]``, :meth:`labkit.comm_handle.Handle.note_done`).

    Such a call's recorded span runs from its issue to the return of its ``wait()``;
    twenty bucketed all-reduces issued during backward and collected after it overlap
    into one solid bar, and a pipeline's send, collected at the end of the flush, spans
    the step. Drawn instead: a collective whose backend reported completion
    (``args["done"]``) as the time from the lane's previous completion (or its issue, if
    later) to its own: the lane's time split among the calls that finished in it, so each
    call is its own bar, ending where it finished (gloo runs a group's collectives on a
    small worker pool, so the split is an attribution, not each call's start: torch 2.13
    gives no start for a gloo work, ``Work._get_duration()`` is unsupported, and only a
    running ``torch.profiler`` sees gloo's ``gloo:<op>`` span start on the worker thread).
    The bar never starts before the issue nor ends after ``done`` or ``wait()``'s return.
    A call with no completion time (gloo's send/recv) draws only the part its caller waited for
    it, ``waited``..``end``, hatched: a wait, which includes whatever of the transfer was
    left. The whole span stays as a thin faint "in flight" line.
    """
    out: dict = {}
    lanes: dict = {}
    for e in events:
        a = e.args or {}
        if e.cat in BLOCKED_CATS or e.cat == COMPUTE or not a.get("async"):
            continue
        if a.get("done") is not None:
            lanes.setdefault((e.rank, S.comm_family(e.op) == "p2p"), []).append(e)
        else:
            waited = a.get("waited")
            lo = e.start if waited is None else min(max(e.start, waited), e.end)
            out[id(e)] = (lo, e.end, "waited")
    for calls in lanes.values():
        prev = float("-inf")
        for e in sorted(calls, key=lambda e: min(e.args["done"], e.end)):
            done = min(max(e.args["done"], e.start), e.end)
            out[id(e)] = (max(e.start, min(prev, done)), done, "done")
            prev = max(prev, done)
    return out


def _inflight_text(trace, e, drawn) -> str:
    """The hover line of an asynchronous call: when it was issued, finished, waited for."""
    a = e.args or {}
    parts = [f"issued {_ms(trace, e.start):.3f} ms"]
    if a.get("done") is not None:
        parts.append(f"finished {_ms(trace, a['done']):.3f} ms (backend)")
    if a.get("waited") is not None:
        parts.append(f"waited for from {_ms(trace, a['waited']):.3f} ms")
    parts.append(f"wait() returned {_ms(trace, e.end):.3f} ms")
    how = ("bar: since the lane's previous completion (or the issue, if later), to this "
           "one's: gloo reports no start" if drawn == "done" else
           "hatched bar: the caller waited (the backend reports no completion time)")
    return "<br>" + " · ".join(parts[:2]) + "<br>" + " · ".join(parts[2:]) + "<br>" + how
