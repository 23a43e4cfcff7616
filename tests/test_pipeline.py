"""Pipeline parallelism through the one training job: parity with one process and with
torch.distributed.pipelining, messages, traced F/B/W spans, measured activation memory and
bubble, bad input. (Compositions with data, tensor, context and expert parallelism: see
tests/test_train.py; two pipelines at once on (0, 2) and (1, 3) there too, ``dp2xpp2-*``.)"""
from __future__ import annotations

import statistics

import pytest
from parity import assert_parity

from labkit import jobs
from labkit.config import ModelConfig, RunConfig
from labkit.parallel.pipeline import PP_TINY
from labkit.parallel.pipeline.bubble import measure_bubble
from labkit.parallel.pipeline.simulate import simulate

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
#: 8 thin layers; first-step gradients and parameters after 2 AdamW steps (adam_eps 1e-6:
#: see tests/test_train.py)
BASE = RunConfig(model=PP_TINY, steps=2, global_batch=8, return_grads=True, return_state=True,
                 measure_memory=False, count_flops=False, adam_eps=1e-6)
UNTIED = ModelConfig(n_layers=8, d_model=32, n_heads=4, seq_len=16, tie_embeddings=False,
                     name="pp-tiny-untied")

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parity_with_single_process(cluster4, schedule, p, m):
    """Every M (1 … 8, below and above P) on 2 and 4 ranks: losses, every rank's first-step
    gradients and final parameters equal one process."""
    cfg = BASE.replace(pp=p, microbatches=m, schedule=schedule)
    assert_parity(cluster4.run(jobs.train, cfg), cfg)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_accumulation_over_two_flushes(cluster4, schedule):
    """2 stages, two flushes of 4 microbatches: the gradient of the single-process mean loss
    over all 16 samples, no scale factor."""
    cfg = BASE.replace(pp=2, global_batch=16, micro_batch=2, microbatches=4, schedule=schedule)
    assert cfg.flushes == 2
    assert_parity(cluster4.run(jobs.train, cfg), cfg)


def test_untied_embeddings(cluster4):
    cfg = BASE.replace(model=UNTIED, pp=4, microbatches=4, schedule="zb-h1")
    assert_parity(cluster4.run(jobs.train, cfg), cfg)


@pytest.mark.parametrize("schedule,model", [("gpipe", PP_TINY), ("1f1b", PP_TINY),
                                            ("interleaved", PP_TINY), ("zb-v", UNTIED)])
def test_same_as_torch_pipelining(cluster4, schedule, model):
    """impl="torch" runs PyTorch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and
    ScheduleZBVZeroBubble on the same stages (ZB-V untied: with the embedding and head tied
    on one rank, torch's ZBV gets the shared weight's gradient wrong, and validate refuses
    it): both it and labkit's executor equal one process on every rank."""
    cfg = BASE.replace(model=model, pp=4, microbatches=4, schedule=schedule)
    theirs = cluster4.run(jobs.train, cfg.replace(impl="torch"))
    assert {m["impl"] for m in theirs.metrics} == {"torch"}
    assert "peak_inflight" not in theirs.metrics[0]  # labkit's executor did not run
    assert not [e for e in theirs.trace.events if e.name in ("F", "B", "W", "BW")]
    assert_parity(theirs, cfg)
    assert_parity(cluster4.run(jobs.train, cfg), cfg)


def test_compute_spans_and_messages(cluster4):
    """Every F/B/W is a traced span with stage and microbatch; each boundary carries
    b·S·H·4 bytes per microbatch each way (claim C33), all through labkit.comm; a tied
    embedding adds one V·H·4-byte gradient exchange between the first and last rank."""
    cfg = BASE.replace(pp=4, microbatches=4, schedule="zb-h1", steps=1, return_grads=False,
                       return_state=False)
    r = cluster4.run(jobs.train, cfg)
    mc = cfg.model_config
    act = cfg.micro * mc.seq_len * mc.d_model * 4
    tied = mc.vocab_size * mc.d_model * 4
    for rank in range(4):
        ev = r.trace.filter(rank=rank, step=0, cat="compute")
        for kind in ("F", "B", "W"):
            got = sorted(e.args["microbatch"] for e in ev if e.name == kind)
            assert got == [0, 1, 2, 3], (rank, kind)
            assert all(e.args["stage"] == rank for e in ev if e.name == kind)
        sent = sum(e.bytes_sent for e in r.trace.filter(rank=rank, step=0, cat="p2p"))
        assert sent == act * 4 * ((rank < 3) + (rank > 0)) + tied * (rank in (0, 3))


def test_activation_memory_gpipe_holds_m_1f1b_at_most_p(cluster4):
    """Measured from the saved tensors' own lifetimes (weak references to their storages,
    not the executor's bookkeeping): GPipe's first stage holds all M microbatches, 1F1B's
    at most P (min(P − r, M) on rank r); the bytes scale with the count. Two steps: the
    meter reads the first, not the one under the memory tracker (whose hooks hold the stage
    inputs)."""
    base = BASE.replace(pp=4, microbatches=8, steps=2, global_batch=16, return_grads=False,
                        return_state=False, measure_memory=True)
    g = cluster4.run(jobs.train, base.replace(schedule="gpipe")).metrics
    o = cluster4.run(jobs.train, base.replace(schedule="1f1b")).metrics
    assert [m["peak_inflight"] for m in g] == [8, 8, 8, 8]
    assert [m["peak_inflight"] for m in o] == [4, 3, 2, 1]
    ratio = g[0]["peak_activation_bytes"] / o[0]["peak_activation_bytes"]
    assert ratio == pytest.approx(8 / 4, rel=0.02)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "zb-v"])
def test_measured_inflight_equals_the_schedules_count(cluster4, schedule):
    """The stage-microbatches whose saved tensors are alive at once, measured, equal the
    schedule's count (F start to BW/W end, independent of timing): a zero-bubble ``W``
    really keeps its stored inputs until it runs, and no longer."""
    cfg = BASE.replace(pp=4, microbatches=8, steps=2, global_batch=16, schedule=schedule,
                       return_grads=False, return_state=False, measure_memory=True)
    got = [m["peak_inflight"] for m in cluster4.run(jobs.train, cfg).metrics]
    assert got == simulate(cfg.build_schedule()).peak_inflight


def test_bubble_measured_beside_simulation(cluster4):
    """What does not depend on the clock: the report's structure, the unit-cost rung
    (3/7), the CPU times every span carries, a bubble between 0 and 1 that no replay of
    the run's own spans beats. (How close measured and simulated come is timing: see
    benchmarks/pipeline_bubble.py.)"""
    cfg = BASE.replace(pp=4, microbatches=4, schedule="1f1b", steps=3, return_grads=False,
                       return_state=False)
    r = cluster4.run(jobs.train, cfg)
    lat = r.metrics[0]["p2p_latency_s"]
    assert lat > 0
    rep = measure_bubble(r.trace, cfg.build_schedule(), comm=lat)
    assert rep.flushes == 2 and len(rep.idle) == 4 and len(rep.per_flush) == 2
    assert 0 < rep.bubble < 1 and 0 < rep.predicted_bubble < 1
    assert rep.mfu_ceiling == pytest.approx(1 - rep.bubble)
    assert set(rep.costs) >= {"F", "BW"} and all(c > 0 for c in rep.costs["F"])
    spans = [e for e in r.trace.events if e.cat == "compute" and "stage" in e.args]
    assert len(spans) == 3 * 2 * 4 * 4
    assert all(0 < e.args["cpu_s"] and e.args["exec_cpu_s"] >= 0 for e in spans)
    assert rep.work["F"] == pytest.approx([statistics.mean(
        e.args["cpu_s"] for e in spans if e.step >= 1 and e.name == "F" and
        e.args["stage"] == s) for s in range(4)])
    assert rep.executor_s > 0
    # the run obeyed the schedule's order and dependencies, so it cannot beat a replay of
    # its own span lengths with free communication
    assert rep.bubble >= rep.replayed_bubble - 1e-9
    assert rep.ladder[0] == ("unit costs", pytest.approx(3 / 7))  # (P−1)/(M+P−1)
    assert rep.ladder[-1] == ("measured", rep.bubble)
    assert [row["rank"] for row in rep.rows()] == [0, 1, 2, 3]


def test_memory_tracked_step_is_left_out_of_the_bubble(cluster4):
    """The last step runs under the memory tracker (its spans stretch): the bubble is read
    from the steps between the first and it."""
    cfg = BASE.replace(pp=2, microbatches=4, steps=3, return_grads=False,
                       return_state=False, measure_memory=True)
    r = cluster4.run(jobs.train, cfg)
    assert {e.args.get("instrumented") for e in r.trace.events if e.step == 2} == {"memory"}
    rep = measure_bubble(r.trace, cfg.build_schedule())
    assert rep.flushes == 1  # step 1 only: step 0 warms up, step 2 is instrumented


@pytest.mark.parametrize("changes,match", [
    (dict(global_batch=8, microbatches=3), r"microbatches=3 per flush does not divide the 4 "),
    (dict(pp=4, schedule="interleaved", virtual_stages=4),
     r"pp x virtual_stages = 4 x 4 = 16 stages but the model has n_layers=8"),
    (dict(schedule="interleaved", virtual_stages=3, model=ModelConfig(n_layers=5)),
     r"pp x virtual_stages = 2 x 3 = 6 stages but the model has n_layers=5"),
    (dict(schedule="pipedream"), r"unknown schedule 'pipedream'"),
    (dict(pp=8), r"pp x cp = 1 x 1 x 8 x 1 = 8 ranks but the cluster has world_size=4"),
    (dict(pp=4, microbatches=2, impl="torch"),
     r"Schedule1F1B needs microbatches >= pp: microbatches=2 < pp=4"),
    (dict(schedule="zb-v", impl="torch"), r"schedule='zb-v' and tie_embeddings=True"),
    # the ranks raised (found by tests/test_matrix.py once it measured memory)
    (dict(schedule="zb-v", impl="torch", measure_memory=True,
          model=UNTIED),
     r"schedule='zb-v' and measure_memory=True: under torch's MemTracker"),
])
def test_bad_input_raises_before_launch(cluster4, changes, match):
    restarts = cluster4.restarts
    with pytest.raises(ValueError, match=match):
        cluster4.run(jobs.train, BASE.replace(pp=2).replace(**changes))
    assert cluster4.restarts == restarts and cluster4.alive


def test_zero_bubble_memory_step_prints_no_tracker_warnings(capfd):
    """MemTracker warns for every ``None`` gradient a zero-bubble stage's hooks see (the
    first stage's input needs none); the tracked step silences exactly that warning, so a
    notebook cell shows no stderr box for a correct run. The ranks write to the stderr they
    inherited, so this starts its own pool under ``capfd``."""
    import labkit

    cfg = BASE.replace(pp=2, microbatches=4, schedule="zb-h1", steps=1, measure_memory=True,
                       return_grads=False, return_state=False)
    with labkit.Cluster(2, replace=False) as cluster:
        cluster.run(jobs.train, cfg)
    out, err = capfd.readouterr()
    assert "Expected a tensor" not in out + err
