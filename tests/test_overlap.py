"""What ``metrics["overlap"]`` counts: the time of the data-parallel (ZeRO-3/FSDP) unit
all-gathers that compute hid, and nothing else — in particular not the asynchronous
all-gathers of sequence parallelism, nor context parallelism's blocking K/V all-gathers,
which run in the same phases of the same step.

Every expected value is worked out here from the trace, choosing the ZeRO all-gathers by
what the FSDP wrapper tags its calls with (``args["unit"]``), not by the mesh axis the
function under test filters on."""
from __future__ import annotations

import pytest

from labkit import jobs
from labkit.config import RunConfig
from labkit.trace import Event
from labkit.train.metrics import overlap_fraction

pytestmark = pytest.mark.distributed

RUN = RunConfig(steps=2, global_batch=8, measure_memory=False, count_flops=False)
PHASES = ("forward", "backward")


def _ag(rank, start, end, axis, phase, **args):
    return Event(rank, "all_gather", "comm", start, end, 1, op="all_gather", bytes_sent=64.0,
                 axis=axis, args={"phase": phase, **args})


def test_tensor_parallel_gathers_are_not_in_the_data_parallel_figure():
    """One ZeRO all-gather of 1 s, blocked 0.25 s: 75 % hidden. A tp all-gather of 3 s in
    the same phase (fully async, nothing blocked on it) must not lift that to
    1 − 0.25 / 4 = 93.75 %; nor may a blocked span on tp lower it."""
    ev = [_ag(0, 0.0, 1.0, "dp", "forward", unit="layers.0"),
          _ag(0, 0.0, 3.0, "tp", "forward", site="attn_in"),
          Event(0, "wait all_gather", "wait", 0.5, 0.75, 1, axis="dp",
                args={"phase": "forward"}),
          Event(0, "wait all_gather", "wait", 2.0, 2.5, 1, axis="tp",
                args={"phase": "forward"}),
          _ag(1, 0.0, 1.0, "dp", "forward", unit="layers.0")]  # another rank's
    got = overlap_fraction(ev, 1, rank=0)
    assert got == {"forward": 0.75, "backward": None, "total": 0.75}
    # a one-rank shard group's gathers move nothing: nothing to hide, on every axis
    assert overlap_fraction([_ag(0, 0.0, 3.0, "tp", "forward")], 1, 0)["total"] is None


def _expected(events, rank: int, step: int, also: tuple = ()) -> tuple:
    """``({phase: fraction}, tp span, ZeRO gathers' axes)`` of ``rank`` in ``step``, from the
    raw events; ``also``: more all-gathers counted beside ZeRO's (what a figure that let
    them in would read)."""
    mine = [e for e in events if e.rank == rank and e.step == step]
    zero = [e for e in mine if e.cat == "comm" and e.op == "all_gather" and "unit" in e.args
            and e.bytes_sent > 0 and e.args.get("phase") in PHASES] + list(also)
    blocked = [e for e in mine if e.cat == "wait"]
    tp = [e for e in mine if e.cat == "comm" and e.op == "all_gather" and "site" in e.args
          and e.bytes_sent > 0 and e.args.get("phase") in PHASES]
    assert zero and blocked, f"rank {rank}: no ZeRO all-gathers or waits in step {step}"
    out = {}
    for key, phases in (("forward", ("forward",)), ("backward", ("backward",)),
                        ("total", None)):
        span = sum(e.duration for e in zero if phases is None or e.args["phase"] in phases)
        wait = sum(e.duration for e in blocked if phases is None or e.args["phase"] in phases)
        out[key] = min(1.0, max(0.0, 1.0 - wait / span))
    return out, sum(e.duration for e in tp), {e.axis for e in zero}


def test_zero3_with_sequence_parallel_overlap_is_the_zero_gathers_alone(cluster4):
    """ZeRO-3 over dp=2 with tp=2 + sequence parallelism: SP's forward and backward
    all-gathers are asynchronous spans in the same phases as ZeRO's unit gathers. On every
    rank the job's figure is the ZeRO gathers' hidden fraction worked out from the trace."""
    cfg = RUN.replace(dp=2, tp=2, sequence_parallel=True, zero_stage=3)
    r = cluster4.run(jobs.train, cfg)
    step = 1  # of 2 steps, none memory-tracked: the second is the steady one
    for rank, m in enumerate(r.metrics):
        want, tp_span, axes = _expected(r.trace.events, rank, step)
        # the case is adversarial only if SP gathered in those phases: it must have
        assert tp_span > 0, f"rank {rank}: no sequence-parallel all-gathers in step {step}"
        assert axes == {"dp"}, axes
        got = m["overlap"]
        for key in ("forward", "backward", "total"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), \
                (f"rank {rank} overlap[{key!r}] = {got[key]}, the ZeRO all-gathers' own "
                 f"hidden fraction is {want[key]} (sequence-parallel all-gathers: "
                 f"{tp_span * 1e3:.3f} ms in the step)")


def test_zero3_with_context_parallel_allgather_overlap_is_the_zero_gathers_alone(cluster4):
    """ZeRO-3 over dp=2 with cp=2 gathering K/V (``cp_method="allgather"``): cp's K/V
    all-gathers are forward all-gathers that block (no wait span is recorded on them), so
    counting them would add unhidden time as if hidden and lift the forward figure. On
    every rank the job's figure is the ZeRO gathers' hidden fraction worked out from the
    trace, the K/V gathers chosen by what they carry (``args["what"] == "kv"``)."""
    cfg = RUN.replace(dp=2, cp=2, zero_stage=3, cp_method="allgather")
    cfg.validate(4)
    r = cluster4.run(jobs.train, cfg)
    step = 1  # of 2 steps, none memory-tracked: the second is the steady one
    for rank, m in enumerate(r.metrics):
        kv = [e for e in r.trace.events if e.rank == rank and e.step == step
              and e.cat == "comm" and e.op == "all_gather" and e.args.get("what") == "kv"
              and e.bytes_sent > 0]
        # the case is adversarial only if cp gathered K/V in a phase the figure counts
        assert kv and {e.args.get("phase") for e in kv} == {"forward"}, \
            f"rank {rank}: no forward K/V all-gathers in step {step}"
        want, _, axes = _expected(r.trace.events, rank, step)
        assert axes == {"dp"}, axes
        lifted, _, _ = _expected(r.trace.events, rank, step, also=tuple(kv))
        # letting them in can only lift the figure (strictly, whenever a ZeRO gather
        # blocked and did not block for longer than the gathers ran: the clock decides)
        assert lifted["forward"] >= want["forward"], (rank, lifted, want)
        got = m["overlap"]
        for key in ("forward", "backward", "total"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), \
                (f"rank {rank} overlap[{key!r}] = {got[key]}, the ZeRO all-gathers' own "
                 f"hidden fraction is {want[key]} (K/V all-gathers counted too: "
                 f"{lifted[key]}; {sum(e.duration for e in kv) * 1e3:.3f} ms of them)")
