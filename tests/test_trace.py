"""Traces: one clock across ranks, Chrome export, byte and overlap queries, and what a rank
ships when a backend callback fires around the send."""
import copy
import json
import pickle

import torch

from labkit import jobs
from labkit.config import RunConfig
from labkit.comm_handle import Handle
from labkit.trace import (MARK, Event, Trace, Tracer, pack_events, region, unpack_events,
                          use_tracer)


def test_tracer_regions_and_contextvar():
    t = Tracer(rank=3)
    with use_tracer(t):
        t.step = 2
        with region("forward", micro=0):
            pass
    with region("outside"):  # no tracer: a no-op
        pass
    assert [(e.name, e.rank, e.step, e.args) for e in t.events] == [("forward", 3, 2, {"micro": 0})]
    t.enabled = False
    with t.region("x"):
        pass
    assert len(t.events) == 1


def test_events_packed_for_the_pipe_come_back_equal():
    """Ranks send their events as tuples; every field, none defaulted, survives the trip."""
    import dataclasses
    import pickle

    e = Event(3, "all_reduce", "comm", 1.5, 2.25, 7, op="all_reduce", bytes_sent=96.0,
              bytes_recv=48.0, axis="dp", peers=(1, 3), args={"bucket": 2})
    assert all(getattr(e, f.name) != f.default for f in dataclasses.fields(Event)
               if f.default is not dataclasses.MISSING)
    assert unpack_events(pickle.loads(pickle.dumps(pack_events([e, Event(0, "f", "compute",
                                                                          0.0, 1.0)])))) == \
        [e, Event(0, "f", "compute", 0.0, 1.0)]


def test_overlap_and_busy_time():
    ev = [Event(0, "backward", "compute", 0.0, 1.0), Event(0, "all_reduce", "comm", 0.5, 1.5,
                                                           op="all_reduce", bytes_sent=8.0)]
    tr = Trace(ev)
    assert tr.overlap_fraction(0) == 0.5
    # a tensor-parallel all-reduce outside backward beside the data-parallel one
    tp = Event(0, "all_reduce", "comm", 2.0, 3.0, op="all_reduce", bytes_sent=8.0, axis="tp")
    dp = Event(0, "all_reduce", "comm", 0.5, 1.5, op="all_reduce", bytes_sent=8.0, axis="dp")
    mixed = Trace([ev[0], dp, tp])
    assert mixed.overlap_fraction(0) == 0.25
    assert mixed.overlap_fraction(0, axis="dp") == mixed.overlap_fraction(0, axis=("dp",)) == 0.5
    assert tr.busy_time(0) == 1.0
    assert tr.comm_bytes(0) == 8.0


def _chrome_entry(e: Event, t0: float) -> dict:
    """The Chrome entry ``e`` must export as, written out field by field: every time
    (``ts``, and the clock readings ``done``/``waited`` in args) in µs from ``t0``."""
    us = lambda t: (t - t0) * 1e6  # noqa: E731
    args = {"step": e.step}
    for k, v in e.args.items():
        args[k] = us(v) if k in ("done", "waited") and v is not None else \
            v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
    if e.cat == MARK:
        return {"ph": "i", "s": "t", "name": e.name, "cat": e.cat, "pid": e.rank, "tid": 0,
                "ts": us(e.start), "args": args}
    if e.op:
        args.update(op=e.op, bytes_sent=e.bytes_sent, bytes_recv=e.bytes_recv, axis=e.axis,
                    peers=list(e.peers))
    return {"ph": "X", "name": e.name, "cat": e.cat, "pid": e.rank,
            "tid": 0 if e.cat == "compute" else 1, "ts": us(e.start),
            "dur": max(e.end - e.start, 0.0) * 1e6, "args": args}


def test_chrome_export_from_a_real_run(cluster2, tmp_path):
    """Bucketed data parallelism on 2 ranks (async all-reduces with ``done`` and ``waited``,
    a memory-tracked step's mark): the written file, loaded back, holds every event of the
    in-memory trace exactly, times in µs from the trace's t0, args' clock readings too."""
    r = cluster2.run(jobs.train, RunConfig(steps=2, count_flops=False, bucket_mb=0.01)
                     .replace(dp=2))
    path = tmp_path / "run.trace.json"
    r.trace.to_chrome(str(path))
    loaded = json.loads(path.read_text())
    meta = [e for e in loaded["traceEvents"] if e["ph"] == "M"]
    entries = [e for e in loaded["traceEvents"] if e["ph"] != "M"]
    assert len(entries) == len(r.trace)
    for got, e in zip(entries, r.trace.events):
        assert got == json.loads(json.dumps(_chrome_entry(e, r.trace.t0))), (e, got)
    async_ar = [(g, e) for g, e in zip(entries, r.trace.events)
                if e.op == "all_reduce" and "done" in e.args and "waited" in e.args]
    assert {e.rank for _, e in async_ar} == {0, 1}  # the clock args are really exercised
    assert any(e.cat == MARK for e in r.trace.events)
    for g, e in async_ar:  # one origin and unit: issue <= done, and done <= wait() returned
        assert g["ts"] <= g["args"]["done"] <= (e.end - r.trace.t0) * 1e6
        assert g["ts"] <= g["args"]["waited"]
    spans = [e for e in entries if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}  # one track per rank
    assert {"forward", "backward", "optimizer", "all_reduce"} <= {e["name"] for e in spans}
    assert min(e["ts"] for e in spans) == 0.0
    names = [e["args"]["name"] for e in meta if e["name"] == "process_name"]
    assert names == ["rank 0", "rank 1"]


class _Work:
    """A work object whose future completes when the test says: the backend's thread,
    made deterministic."""

    def __init__(self):
        self.fut = torch.futures.Future()

    def get_future(self):
        return self.fut

    def wait(self):
        self.fut.wait()


def _left_in_flight(tracer: Tracer, work: _Work, **args) -> Event:
    """An async all-reduce closed without a wait before its backend reported (as a comm
    hook's ``complete()`` may be), so its ``done`` is still to come."""
    with use_tracer(tracer):
        ev = Event(0, "all_reduce", "comm", tracer.now(), 0.0, op="all_reduce", args=args)
        h = Handle(work, ev)
        h.note_done()
        h.complete()
    return ev


def test_a_completion_between_snapshot_and_send_changes_nothing_shipped():
    tracer, work = Tracer(0), _Work()
    ev = _left_in_flight(tracer, work)
    shipped = tracer.packed()  # what the rank sends (labkit.worker)
    frozen = copy.deepcopy(shipped)
    work.fut.set_result(None)  # the backend's callback fires after the snapshot, before send
    assert pickle.loads(pickle.dumps(shipped)) == frozen
    assert "done" not in tracer.events[0].args  # nor written into the recorded event
    (later,) = unpack_events(tracer.packed())  # it enters at the next snapshot
    assert ev.start <= later.args["done"] and later.args["async"] is True


def test_a_completion_while_the_events_are_pickled_changes_nothing_shipped():
    tracer, work = Tracer(0), _Work()

    class FiresWhenPickled:
        def __reduce__(self):
            work.fut.set_result(None)  # the backend finishes the call mid-send
            return (str, ("fired",))

    _left_in_flight(tracer, work, probe=FiresWhenPickled())
    (shipped,) = unpack_events(pickle.loads(pickle.dumps(tracer.packed())))
    assert shipped.args == {"probe": "fired", "async": True}


def test_a_completion_before_the_record_is_in_the_event():
    """gloo's order: the future's callbacks run before ``wait()`` returns."""
    tracer, work = Tracer(0), _Work()
    with use_tracer(tracer):
        ev = Event(0, "all_reduce", "comm", tracer.now(), 0.0, op="all_reduce")
        h = Handle(work, ev)
        h.note_done()
        work.fut.set_result(None)
        h.wait()
    (got,) = tracer.events
    assert got.start <= got.args["waited"] and got.start <= got.args["done"] <= got.end


def test_ranks_share_one_clock(cluster2):
    """Both ranks leave an all-reduce at (nearly) the same instant on the shared clock."""
    r = cluster2.run(jobs.hello)
    ends = [e.end for e in r.trace.filter(op="all_reduce")]
    assert len(ends) == 2 and abs(ends[0] - ends[1]) < 0.05


def test_the_counts_shown_agree():
    """The trace's repr, the timeline's title and the Chrome file count the same events,
    each saying what it counts: spans (drawn) + marks = events; the file adds one
    process-name and two thread-name entries per rank."""
    from labkit_widgets.timeline import TimelineView

    ev = [Event(r, n, "compute", t, t + 1.0, 0) for r in (0, 1) for t, n in ((0.0, "forward"),
                                                                            (1.0, "backward"))]
    ev += [Event(r, "all_reduce", "comm", 2.0, 3.0, 0, op="all_reduce", bytes_sent=8.0,
                 peers=(0, 1)) for r in (0, 1)]
    ev += [Event(0, "memory-tracked", MARK, 0.0, 0.0, 0)]
    tr = Trace(ev)
    assert "Trace(7 events: 6 spans + 1 marks, ranks=[0, 1]" in repr(tr)
    assert ", 6 spans on " in TimelineView(tr).fig.layout.title.text
    entries = tr.to_chrome()["traceEvents"]
    assert len(entries) == len(tr) + 3 * 2
    assert sum(e["ph"] == "M" for e in entries) == 3 * 2
