"""The planner's step on measured links, following what labkit's job overlaps and its
pipeline schedule (labkit.measure.step_model): synthetic traces, hand-computed times."""
import pytest

from labkit.measure.step_model import _replay, classify, predict_step
from labkit.parallel.pipeline.schedules import build
from labkit.plan.emulated import emulated_spec
from labkit.plan.network import collective_time, place
from labkit.trace import Event


def _c(start, end, name="layer", **args):
    return Event(0, name, "compute", start, end, step=1, args=args)


def _ar(start, end, nbytes=1e6):
    return Event(0, "all_reduce", "comm", start, end, step=1, op="all_reduce",
                 bytes_sent=nbytes, peers=(0, 1))


def test_blocking_call_costs_its_prediction_overlapped_only_what_compute_does_not_hide():
    price = {"all_reduce": 0.7}
    cost = lambda e: price[e.op]  # noqa: E731
    # compute 1 s, a blocking all-reduce measured 2 s (nothing computes inside), compute 1 s
    ev = [_c(0, 1), _ar(1, 3), _c(3, 4)]
    assert classify(ev[1:2], [ev[0], ev[2]])[id(ev[1])] == "blocking"
    assert _replay(ev, cost) == pytest.approx(2 + 0.7)
    # issued at 0, collected at 2.5; 1.9 s of compute inside; then 0.5 s more
    ev = [_ar(0, 2.5), _c(0.1, 2.0), _c(2.5, 3.0)]
    assert classify(ev[:1], ev[1:])[id(ev[0])] == "overlapped"
    assert _replay(ev, cost) == pytest.approx(1.9 + 0.5)           # 0.7 s hidden
    price["all_reduce"] = 3.0
    assert _replay(ev, cost) == pytest.approx(3.0 + 0.5)           # 1.1 s exposed
    # two overlapped calls of one group share its stream: the second starts when the
    # first ends; a call of another group runs beside them
    ev = [_ar(0, 2.5), _ar(0.05, 2.6), _c(0.1, 2.0)]
    price["all_reduce"] = 1.5
    assert _replay(ev, cost) == pytest.approx(3.0)
    other = _ar(0.05, 2.6)
    other.peers = (0, 2)
    assert _replay([ev[0], other, ev[2]], cost) == pytest.approx(1.9)
    # DDP: a bucket issued in backward, collected by grad_sync after the backward ends:
    # grad_sync's span is the wait, not compute (0..2 s backward, 0.1 s after)
    ev = [_c(0, 2, "backward"), _ar(1.5, 5), _c(1.8, 5.1, "grad_sync")]
    price["all_reduce"] = 0.3
    assert _replay(ev, cost) == pytest.approx(2.1)
    price["all_reduce"] = 3.0
    assert _replay(ev, cost) == pytest.approx(1.5 + 3.0 + 0.1)
    # a wait span inside a compute span is not compute
    ev = [_c(0, 2), Event(0, "wait all_gather", "wait", 0.5, 1.0, step=1)]
    assert _replay(ev, cost) == pytest.approx(1.5)


class _Trace:
    def __init__(self, events):
        self.events = events

    def filter(self, rank=None, step=None):
        return [e for e in self.events if (rank is None or e.rank == rank)
                and (step is None or e.step == step)]


def test_pipeline_bubble_and_p2p_on_the_critical_path():
    """1F1B, 2 stages, 2 microbatches, F = 1 s, B = 2 s, one activation's transfer c:
    rank 0 F0 F1 · B0 B1, rank 1 F0 B0 F1 B1 → makespan 9 + 2c (the bubble: 3 s on each
    rank beyond its own 6 s; two transfers on the critical path)."""
    spec = emulated_spec(2, 1, 400e6, 100e6, 1e-3, 2e-3)
    msg = 4e6
    c = 8.4e-6 + 2e-3 + msg / 100e6  # measured busbw: no further link efficiency
    assert collective_time("send_recv", msg, place(spec, (2, 1)), 1.0) == pytest.approx(c)
    ev = []
    for r in range(2):
        for i in range(2):
            ev.append(Event(r, "F", "compute", 10 * i, 10 * i + 1, step=1,
                            args={"stage": r, "microbatch": i}))
            ev.append(Event(r, "B", "compute", 10 * i + 2, 10 * i + 4, step=1,
                            args={"stage": r, "microbatch": i}))
        ev.append(Event(r, "isend", "p2p", 0.0, 0.1, step=1, op="isend", bytes_sent=msg,
                        axis="pp", peers=(1 - r,)))
    phys = {0: 0, 1: 1}
    out = predict_step(_Trace(ev), [0, 1], [1], spec, phys, schedule=build("1f1b", 2, 2))
    assert out["pipeline_s"] == pytest.approx(9 + 2 * c)
    assert out["step_s"] == pytest.approx(9 + 2 * c)
    assert out["bubble"] == pytest.approx((2 * (9 + 2 * c) - 12) / (2 * (9 + 2 * c)))
    # the same events without a schedule: each rank's own compute, no bubble
    flat = predict_step(_Trace([e for e in ev if e.cat == "compute"]), [0, 1], [1], spec,
                        phys)
    assert flat["step_s"] == pytest.approx(6.0)


def test_a_collective_starts_when_its_last_member_arrives():
    """Rank 0 computes 1 s, rank 1 3 s, then both all-reduce (0.5 s predicted) and compute
    0.2 s: together both end at 3 + 0.5 + 0.2; rank 0 alone would end at 1.7."""
    from labkit.measure.step_model import _replay_ranks

    def rank(r, busy):
        return [Event(r, "f", "compute", 0, busy, step=1),
                Event(r, "all_reduce", "comm", busy, busy + 2, step=1, op="all_reduce",
                      bytes_sent=1e6, peers=(0, 1)),
                Event(r, "g", "compute", busy + 2, busy + 2.2, step=1)]

    cost = lambda e: 0.5  # noqa: E731
    got = _replay_ranks({0: rank(0, 1.0), 1: rank(1, 3.0)}, cost)
    assert got == pytest.approx({0: 3.7, 1: 3.7})
    assert _replay(rank(0, 1.0), cost) == pytest.approx(1.7)
