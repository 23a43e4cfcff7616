"""Traces: one clock across ranks, Chrome export, byte and overlap queries."""
import json

from labkit import jobs
from labkit.config import RunConfig
from labkit.trace import Event, Trace, Tracer, pack_events, region, unpack_events, use_tracer


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


def test_chrome_export_from_a_real_run(cluster2, tmp_path):
    r = cluster2.run(jobs.train, RunConfig(steps=2, measure_memory=False, count_flops=False)
                     .replace(dp=2))
    path = tmp_path / "run.trace.json"
    doc = r.trace.to_chrome(str(path))
    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(doc))
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}  # one track per rank
    assert {"forward", "backward", "optimizer", "all_reduce"} <= {e["name"] for e in spans}
    assert min(e["ts"] for e in spans) == 0.0
    ar = [e for e in spans if e["name"] == "all_reduce"]
    assert all(e["tid"] == 1 and e["args"]["bytes_sent"] > 0 for e in ar)
    names = [e["args"]["name"] for e in loaded["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0", "rank 1"]


def test_ranks_share_one_clock(cluster2):
    """Both ranks leave an all-reduce at (nearly) the same instant on the shared clock."""
    r = cluster2.run(jobs.hello)
    ends = [e.end for e in r.trace.filter(op="all_reduce")]
    assert len(ends) == 2 and abs(ends[0] - ends[1]) < 0.05


def test_the_counts_shown_agree():
    """The trace's repr, the timeline's title and the Chrome file count the same events,
    each saying what it counts: spans (drawn) + marks = events; the file adds one
    process-name and two thread-name entries per rank."""
    from labkit.trace import MARK
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
