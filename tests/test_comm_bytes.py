"""What labkit.comm's byte counts are: the formula for native collectives (said so in every
trace event), the payload handed to the backend for point-to-point calls — and so for the
hand-built algorithms made of them."""
from __future__ import annotations

import pytest

from labkit import comm

pytestmark = pytest.mark.distributed

NATIVE = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"}


def test_native_bytes_are_labelled_formula_and_p2p_bytes_measured(cluster2):
    r = cluster2.run("jobs_comm:every_call", None, nranks=2)
    for rank in range(2):
        evs = [e for e in r.trace.events if e.rank == rank and e.cat in ("comm", "p2p")]
        comm_ops = {e.op for e in evs if e.cat == "comm"}
        assert comm_ops == NATIVE
        for e in evs:
            want = comm.BYTES_FORMULA if e.cat == "comm" else comm.BYTES_MEASURED
            assert e.args["bytes"] == want, (e.op, e.cat, e.args)
        # the ring all-reduce of 16 bytes over 2 ranks: 2 steps of one 8-byte chunk each way,
        # all of it point-to-point payload — 2(N−1)/N·S = 16 bytes sent, counted not assumed
        span = next(e for e in r.trace.events if e.rank == rank and e.name == "ring all-reduce")
        ring = [e for e in evs if span.start <= e.start <= span.end]
        assert sum(e.bytes_sent for e in ring) == 16
        assert all(e.args["bytes"] == "measured" for e in ring)
        # a call left in flight records when the backend finished it (a future callback)
        # and when its caller began to wait; gloo's send/recv have no future: no "done"
        sync_ar, async_ar = [e for e in evs if e.op == "all_reduce"][:2]
        assert "async" not in sync_ar.args and async_ar.args["async"] is True
        assert async_ar.start <= async_ar.args["done"]
        assert async_ar.start <= async_ar.args["waited"] <= async_ar.end
        p2p = next(e for e in evs if e.args.get("async") and e.cat == "p2p")
        assert "done" not in p2p.args and p2p.start <= p2p.args["waited"] <= p2p.end
