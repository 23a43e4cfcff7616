"""Pipeline schedules as data, checked without processes (claims C30, C31, C32).

Bubble definitions used below (see labkit.parallel.pipeline.simulate):
  * "idle/total"          = Σ idle / (P · makespan)       → (P−1)/(M+P−1) for GPipe/1F1B
  * "relative to ideal"   = Σ idle / Σ busy               → (P−1)/M
  * "idle time"           = absolute idle per rank, in cost units (the paper's bubble size)
"""
from __future__ import annotations

import numpy as np
import pytest

from labkit.parallel.pipeline.schedules import (SCHEDULES, Action, Schedule, build, gpipe,
                                                interleaved_1f1b, one_f_one_b, with_comms,
                                                zb_h1, zb_v)
from labkit.parallel.pipeline.simulate import ScheduleError, simulate

UNIT = {"F": 1, "B": 1, "W": 1}


def _m(name: str, p: int, m: int) -> int:
    """``m``, or the fewest microbatches the schedule runs (DualPipeV: one per stage)."""
    return max(m, 2 * p) if name == "dualpipe-v" else m


def _f_before_first_backward(acts):
    return next(k for k, a in enumerate(acts) if a.kind != "F")


def test_1f1b_warmup_forwards_p4_m8():
    s = one_f_one_b(4, 8)
    assert s.warmup == (3, 2, 1, 0)
    # the warm-up forwards, plus the one that opens the steady 1F1B pairs
    assert [_f_before_first_backward(a) for a in s.actions] == [4, 3, 2, 1]


def test_interleaved_warmup_forwards_v2():
    s = interleaved_1f1b(4, 8, 2)
    assert s.warmup == (10, 8, 6, 4)
    assert [_f_before_first_backward(a) for a in s.actions] == [11, 9, 7, 5]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_unit_cost_bubble_formula(name, p, m):
    """claim C31. Definition: idle/total = (P−1)/(M+P−1); relative to ideal = (P−1)/M."""
    r = simulate(build(name, p, m), UNIT)
    assert r.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert r.bubble_vs_ideal == pytest.approx((p - 1) / m)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_interleaved_divides_bubble_by_v(p, m, v):
    """Definition: relative to ideal. 1F1B: (P−1)/M; interleaved: (P−1)/(V·M)."""
    base = simulate(one_f_one_b(p, m), UNIT).bubble_vs_ideal
    r = simulate(interleaved_1f1b(p, m, v), UNIT)
    assert r.bubble_vs_ideal == pytest.approx(base / v)
    assert r.bubble_vs_ideal == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_zb_h1_has_a_third_of_1f1b_bubble(p, m):
    """claim C32. Definition: idle time per rank (Qi et al. 2023 §3.1): 1F1B
    (P−1)(T_F+T_B+T_W) = 3(P−1), ZB-H1 (P−1)(T_F+T_B−T_W) = P−1 with unit costs."""
    ref = simulate(one_f_one_b(p, m), UNIT)
    zb = simulate(zb_h1(p, m), UNIT)
    assert zb.idle == [p - 1.0] * p
    assert ref.idle == [3.0 * (p - 1)] * p
    assert sum(zb.idle) / sum(ref.idle) == pytest.approx(1 / 3)
    assert zb.bubble < ref.bubble  # idle/total drops too
    assert max(zb.peak_inflight) <= p  # 1F1B's peak memory


def test_lecture_4_stages_1_microbatch_at_most_25_percent():
    """claim C30. Definition: idle/total (utilisation = 1 − bubble)."""
    for costs in (UNIT, {"F": 1, "B": 2, "W": 0}, {"F": [1, 2, 1, 3], "B": 1, "W": 1}):
        for name in ("gpipe", "1f1b"):  # the naive pipeline: one stage busy at a time
            r = simulate(build(name, 4, 1), costs)
            assert r.utilisation <= 0.25 + 1e-9, (name, costs)
    assert simulate(gpipe(4, 1), UNIT).utilisation == pytest.approx(0.25)
    # splitting W off lets it overlap the next stage's B: above 25% (claim C32)
    assert simulate(zb_h1(4, 1), UNIT).utilisation == pytest.approx(1 / 3)


def test_lecture_4_stages_4_microbatches_16_of_28():
    """claim C30. Definition: idle/total: 4 ranks x 4 microbatches busy of 4 x 7 slots."""
    for costs in ({"F": 1, "BW": 0}, UNIT, {"F": 1, "B": 2, "W": 0}):
        r = simulate(gpipe(4, 4), {**{"B": 0, "W": 0}, **costs})
        assert r.utilisation == pytest.approx(16 / 28)
        assert round(r.utilisation, 3) == 0.571


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (2, 8)])
def test_peak_inflight_microbatches(p, m):
    assert simulate(gpipe(p, m)).peak_inflight == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_inflight == [min(p - r, m) for r in range(p)]
    assert max(simulate(zb_v(p, m)).peak_inflight) <= 2 * p  # half-size stages: 1F1B's peak


def test_zb_v_places_first_and_last_stage_on_rank_0_and_beats_1f1b():
    s = zb_v(4, 8)
    assert s.stage_rank(0) == s.stage_rank(7) == 0 and s.stages_of(3) == [3, 4]
    half = {"F": 0.5, "B": 0.5, "W": 0.5}  # each of the 2P stages holds half a rank's layers
    v = simulate(s, half)
    ref = simulate(one_f_one_b(4, 8), UNIT)
    assert v.bubble < 0.5 * ref.bubble  # idle/total
    assert sum(v.busy) == pytest.approx(sum(ref.busy))


def test_action_string_form_round_trips():
    for text in ("1F0", "2B3", "0W1", "3BW12", "1SEND_F0", "2RECV_B7"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2B3") == Action(2, "B", 3)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F1")


def test_with_comms_pairs_every_send_with_a_recv():
    for name in SCHEDULES:
        s = with_comms(build(name, 4, _m(name, 4, 4)))
        sends = {(a.kind[-1], a.stage, a.microbatch) for acts in s.actions for a in acts
                 if a.kind.startswith("SEND")}
        recvs = {(a.kind[-1], a.stage - 1 if a.kind == "RECV_F" else a.stage + 1, a.microbatch)
                 for acts in s.actions for a in acts if a.kind.startswith("RECV")}
        assert sends == recvs and sends, name
        simulate(s)  # lowered lists still simulate (comm actions cost nothing)


def _sched(*rows, p=2, m=1):
    return Schedule("custom", p, m, 1, "loop",
                    tuple(tuple(Action.parse(t) for t in row.split()) for row in rows))


def test_bad_order_is_named():
    s = _sched("0F0 0W0 0B0", "1F0 1BW0")
    with pytest.raises(ScheduleError, match="bad order on rank 0: 0W0 is listed before 0B0"):
        simulate(s)


def test_deadlock_is_named():
    s = _sched("0F0 0BW0 0F1 0BW1", "1F1 1BW1 1F0 1BW0", m=2)
    with pytest.raises(ScheduleError, match=r"deadlock: .*rank 0 waits at 0BW0 for 1B0 \(rank 1\)"):
        simulate(s)


def test_incomplete_or_misplaced_schedule_is_named():
    with pytest.raises(ScheduleError, match="missing backward 1BW0"):
        simulate(_sched("0F0 0BW0", "1F0"))
    with pytest.raises(ScheduleError, match="rank 0 runs 1F0 but stage 1 lives on rank 1"):
        simulate(_sched("0F0 1F0 0BW0", "1BW0"))


def test_unknown_schedule_and_bad_virtual_stages():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe"):
        build("pipedream", 4, 4)
    with pytest.raises(ValueError, match="virtual_stages >= 2, got 1"):
        interleaved_1f1b(4, 4, 1)
    with pytest.raises(ValueError, match="microbatches=6 .* pp=4"):
        interleaved_1f1b(4, 6, 2)


def test_every_schedule_simulates_under_uneven_costs():
    costs = {"F": [1.0, 1.5, 1.0, 2.0], "B": [2.0, 1.0, 1.2, 1.0], "W": 0.7}
    for name in ("gpipe", "1f1b", "zb-h1"):
        for m in (1, 3, 8):
            r = simulate(build(name, 4, m), costs, comm=0.2)
            assert r.makespan > 0 and all(i >= 0 for i in r.idle)


def test_comm_and_dispatch_delays_in_the_simulator():
    """GPipe P=2, M=1, F=1, BW=2: F0 [0,1]; F1 waits one hop [1+c, 2+c]; BW1 follows after
    one dispatch gap [2+c+d, 4+c+d]; BW0 waits one hop for its gradient: makespan 6+2c+d."""
    sched = build("gpipe", 2, 1)
    c, d = 0.25, 0.5
    res = simulate(sched, {"F": 1.0, "B": 2.0, "W": 0.0}, comm=c, dispatch=d)
    assert res.makespan == pytest.approx(6 + 2 * c + d)
    assert res.idle == pytest.approx([res.makespan - 3.0] * 2)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_overheads_and_explained_bubble_round_trip_a_simulated_trace(name, p, m):
    """A trace made by the simulator with hop time = dispatch gap = g: measure_bubble reads
    back g for both, and the explained rung reproduces the trace's bubble exactly."""
    from labkit.parallel.pipeline.bubble import measure_bubble, overheads
    from labkit.trace import Event

    sched = build(name, p, _m(name, p, m), 2 if name == "interleaved" else None)
    costs = {"F": [1.0 + 0.1 * s for s in range(sched.n_stages)], "B": 2.0, "W": 1.0}
    if not sched.split_backward:
        costs = {"F": costs["F"], "BW": 3.0, "B": 2.0, "W": 1.0}
    g = 0.3
    sim = simulate(sched, costs, comm=g, dispatch=g)
    events = [Event(sp.rank, sp.action.kind, "compute", sp.start, sp.end, step=0,
                    args={"stage": sp.action.stage, "microbatch": sp.action.microbatch,
                          "flush": 0}) for sp in sim.spans]
    assert overheads(events, sched) == pytest.approx((g, g))
    rep = measure_bubble(events, sched, comm=0.0)
    assert rep.bubble == pytest.approx(sim.bubble)
    assert rep.explained.bubble == pytest.approx(sim.bubble)
    assert rep.explained_gap_pp == pytest.approx(0.0, abs=1e-9)
    assert rep.gap_pp > 0  # the comm-free prediction misses the overheads
    rungs = [b for _, b in rep.ladder]
    assert rungs[-1] == rep.bubble and rungs[-2] == rep.predicted.bubble
    assert rep.cores is None and rep.executor_s == 0.0  # a hand-made trace has no CPU times


def test_measure_bubble_refuses_a_schedule_the_trace_did_not_run():
    from labkit.parallel.pipeline.bubble import measure_bubble
    from labkit.trace import Event

    ran = build("1f1b", 2, 4)
    events = [Event(sp.rank, sp.action.kind, "compute", sp.start, sp.end, step=s,
                    args={"stage": sp.action.stage, "microbatch": sp.action.microbatch,
                          "flush": 0})
              for s in (0, 1) for sp in simulate(ran).spans]
    assert measure_bubble(events, ran).flushes == 1  # step 0 skipped
    for other in (build("1f1b", 2, 8), build("gpipe", 4, 2), build("zb-h1", 2, 4),
                  build("gpipe", 2, 4)):  # the same actions as 1F1B, in another order
        with pytest.raises(ValueError, match="pass the schedule the run used"):
            measure_bubble(events, other)
    with pytest.raises(ValueError, match=r"skip_steps=5 leaves no flush: the trace holds "
                                         r"steps 0–1"):
        measure_bubble(events, ran, skip_steps=5)
    assert measure_bubble([e for e in events if e.step == 0], ran).flushes == 1
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        measure_bubble(events, "1f1b")
    for bad in (-1, 1.5, True, "1", None):
        with pytest.raises(ValueError, match="skip_steps must be an int >= 0"):
            measure_bubble(events, ran, skip_steps=bad)
    with pytest.raises(TypeError, match="trace must be"):
        measure_bubble(None, ran)
    assert measure_bubble(events, ran, skip_steps=np.int64(1), comm=np.float32(1e-4)).flushes == 1
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="comm must be a finite number"):
            measure_bubble(events, ran, comm=bad)


def test_shared_cores_worked_example():
    """GPipe P=2, M=2, F=1, BW=2 on 1.5 cores. Rank 0's F0 runs alone [0, 1]; then its F1
    and rank 1's F0 share the cores at 0.75 each, ending at 1 + 1/0.75; rank 1's F1 and BW0
    run alone; rank 0's BW0 and rank 1's BW1 share again (2/0.75 each); rank 0's BW1 runs
    alone: makespan 10 (9 on a core per rank)."""
    sched = build("gpipe", 2, 2)
    costs = {"F": 1.0, "B": 2.0, "W": 0.0}
    assert simulate(sched, costs).makespan == pytest.approx(9.0)
    r = simulate(sched, costs, cores=1.5)
    ends = {(sp.rank, str(sp.action)): sp.end for sp in r.spans}
    assert ends[(0, "0F1")] == ends[(1, "1F0")] == pytest.approx(1 + 1 / 0.75)
    assert ends[(1, "1BW0")] == pytest.approx(1 + 1 / 0.75 + 3)
    assert ends[(0, "0BW0")] == ends[(1, "1BW1")] == pytest.approx(1 + 1 / 0.75 + 3 + 2 / 0.75)
    assert r.makespan == pytest.approx(10.0)
    assert r.busy == pytest.approx([1 + 1 / 0.75 + 2 / 0.75 + 2, 1 / 0.75 + 1 + 2 + 2 / 0.75])


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_core_serialises_and_enough_cores_change_nothing(name):
    """On one core some rank always has work, so the makespan is the total work; with a
    core per rank the simulation is the unshared one."""
    sched = build(name, 4, 8)
    costs = {"F": [1.0 + 0.1 * s for s in range(sched.n_stages)], "B": 2.0, "W": 1.0}
    free = simulate(sched, costs, comm=0.2)
    assert simulate(sched, costs, cores=1).makespan == pytest.approx(sum(free.busy))
    same = simulate(sched, costs, comm=0.2, cores=4)
    assert same.makespan == free.makespan and same.idle == free.idle
    near = simulate(sched, costs, comm=0.2, cores=3.999999)
    assert near.makespan == pytest.approx(free.makespan, rel=1e-5)
    assert simulate(sched, costs, cores=2).bubble < free.bubble  # busy spans stretch


def test_cores_must_be_a_positive_number():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="cores must be a finite number > 0"):
            simulate(build("1f1b", 2, 2), cores=bad)


def _trace_of(sim, work=None, exec_s=None):
    from labkit.trace import Event

    out = []
    for sp in sim.spans:
        args = {"stage": sp.action.stage, "microbatch": sp.action.microbatch, "flush": 0}
        if work is not None:
            args.update(cpu_s=work(sp.action), exec_cpu_s=exec_s)
        out.append(Event(sp.rank, sp.action.kind, "compute", sp.start, sp.end, step=0,
                         args=args))
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m,cores", [(2, 4, 1.5), (4, 8, 1.8), (4, 4, 2.5)])
def test_machine_terms_round_trip_a_simulated_trace(name, p, m, cores):
    """A trace made by the simulator with a dispatch gap d and a message time c, whose spans
    carry their work as CPU seconds and d as the executor's CPU time: measure_bubble reads
    back d, its simulation on this machine reproduces the trace's bubble, and the bands add
    up to it. The same schedule run with processor sharing on ``cores`` cores: the cores are
    read back and the ``shared`` diagnostic reproduces that trace's flush time."""
    from labkit.parallel.pipeline.bubble import bubble_bands, measure_bubble

    sched = build(name, p, _m(name, p, m), 2 if name == "interleaved" else None)
    f = [1.0 + 0.1 * s for s in range(sched.n_stages)]
    # DualPipeV mixes full and split backwards
    costs = {"F": f, "B": 2.0, "W": 1.0, "BW": 3.0} if sched.split_backward else {"F": f, "BW": 3.0}
    work = lambda a: f[a.stage] if a.kind == "F" else costs[a.kind]  # noqa: E731
    c, d = 0.05, 0.02
    sim = simulate(sched, costs, comm=c, dispatch=d)
    rep = measure_bubble(_trace_of(sim, work, d), sched, comm=c)
    assert rep.cores is None and rep.shared is None  # a core per rank: no sharing seen
    assert rep.executor_s == pytest.approx(d)
    assert rep.predicted.bubble == pytest.approx(sim.bubble, abs=1e-9)
    assert rep.gap_pp == pytest.approx(0.0, abs=1e-6)
    assert rep.dedicated.bubble != pytest.approx(sim.bubble, abs=1e-4)  # the executor counts
    bands = bubble_bands(rep)
    assert [b["name"] for b in bands] == ["schedule", "stage costs + messages", "executor",
                                          "unexplained"]
    assert sum(b["delta"] for b in bands) == pytest.approx(rep.bubble)
    assert bands[0]["bubble"] == pytest.approx(simulate(sched).bubble)
    assert bands[-1]["delta"] == pytest.approx(0.0, abs=1e-8)

    shared = simulate(sched, costs, comm=c, dispatch=d, cores=cores)
    rep = measure_bubble(_trace_of(shared, work, d), sched, comm=c)
    assert rep.cores == pytest.approx(cores, rel=1e-6)
    assert rep.shared.makespan == pytest.approx(rep.window, rel=1e-6)
    assert rep.predicted.bubble == pytest.approx(sim.bubble, abs=1e-9)  # the work, unshared
    assert f"ranks got {cores:.2f} cores" in rep.summary()


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_fitted_comm_reads_back_the_hop_delay(name):
    """A trace made with a per-hop delay g (no other gap): the fitted per-hop delay is g."""
    from labkit.parallel.pipeline.bubble import measure_bubble

    sched = build(name, 4, 4)
    g = 0.37
    sim = simulate(sched, {"F": 1.0, "B": 2.0, "W": 1.0, "BW": 3.0}, comm=g)
    assert measure_bubble(_trace_of(sim), sched).fitted_comm_s == pytest.approx(g, rel=1e-6)
    still = simulate(sched, {"F": 1.0, "B": 2.0, "W": 1.0, "BW": 3.0})
    assert measure_bubble(_trace_of(still), sched).fitted_comm_s == pytest.approx(0, abs=1e-9)


def _posts(lowered, sched):
    """Per receive: (post time, producer start, producer end, slot, consumer index) in the
    unit-cost timeline; the post time is the end of the consumer's previous compute."""
    sim = simulate(sched)
    start = {(sp.action.kind, sp.action.stage, sp.action.microbatch): sp.start for sp in sim.spans}
    end = {(sp.action.kind, sp.action.stage, sp.action.microbatch): sp.end for sp in sim.spans}
    for (k, s, i) in list(start):
        if k == "BW":
            start[("B", s, i)], end[("B", s, i)] = start[(k, s, i)], end[(k, s, i)]
    out = []
    for acts in lowered.actions:
        t, k, comp = 0.0, 0, [a for a in acts if a.is_compute]
        for a in acts:
            if a.is_compute:
                t, k = end[(a.kind, a.stage, a.microbatch)], k + 1
            elif a.kind.startswith("RECV"):
                prod = (("F", a.stage - 1, a.microbatch) if a.kind == "RECV_F"
                        else ("B", a.stage + 1, a.microbatch))
                use = next(j for j, c in enumerate(comp) if c.stage == a.stage and
                           c.microbatch == a.microbatch and
                           (c.kind == "F") == (a.kind == "RECV_F"))
                out.append((t, start[prod], end[prod], k, use))
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8)])
def test_early_receives_are_posted_before_the_producer_starts(name, p, m):
    """``with_comms(early=True)``: in the unit-cost timeline every receive is posted no
    later than its producer starts (so it waits for the sender, never the reverse), still
    at least ``prefetch`` computes before the one that needs it."""
    sched = build(name, p, _m(name, p, m), 2 if name == "interleaved" else None)
    for prefetch in (0, 2):
        for post, p_start, _, slot, use in _posts(with_comms(sched, prefetch, early=True), sched):
            assert post <= p_start + 1e-9
            assert slot <= max(0, use - prefetch)


def test_late_receives_without_early_posting():
    """What early posting fixes: with receives a fixed 2 computes ahead, interleaved and
    ZB-V at P=4, M=8 post some receives after the producer has already finished."""
    for name in ("interleaved", "zb-v"):
        sched = build(name, 4, 8)
        late = [1 for post, _, p_end, _, _ in _posts(with_comms(sched, 2), sched) if post >= p_end]
        assert late, name


def test_pp_ranks_are_checked():
    from labkit.config import ModelConfig
    from labkit.parallel.pipeline.executor import PipelineExecutor
    from labkit.parallel.pipeline.stage import TiedEmbedding, build_stages

    mc = ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8)
    sched = build("1f1b", 2, 2)
    stages = build_stages(mc, [1], 2)
    ex = PipelineExecutor(sched, stages, 1, None, (1, 8, 16), pp_ranks=(5, 3))
    assert ex.pp_ranks == (5, 3)
    assert PipelineExecutor(sched, stages, 1, None, (1, 8, 16)).pp_ranks == (0, 1)
    assert TiedEmbedding(mc, sched, 1, stages, None, pp_ranks=(5, 3)).peer == 5
    assert TiedEmbedding(mc, sched, 1, stages, None).peer == 0
    for bad, match in (((0,), "has 1 entries for pp=2"), ((1, 1), "repeats a global rank"),
                       ((0, -1), "global rank >= 0"), ((0, 1.0), "global rank >= 0")):
        with pytest.raises(ValueError, match=match):
            PipelineExecutor(sched, stages, 1, None, (1, 8, 16), pp_ranks=bad)
        with pytest.raises(ValueError, match=match):
            TiedEmbedding(mc, sched, 1, stages, None, pp_ranks=bad)
    with pytest.raises(ValueError, match="rank=2 is not a stage-rank of a pipeline of pp=2"):
        PipelineExecutor(sched, stages, 2, None, (1, 8, 16))
