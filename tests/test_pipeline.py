"""Pipeline executor: parity with one process and with torch.distributed.pipelining,
messages, traced F/B/W regions, measured activation memory and bubble, bad input."""
from __future__ import annotations

import statistics

import pytest

from labkit.config import ModelConfig
from labkit.parallel.pipeline import jobs as pj
from labkit.parallel.pipeline.bubble import measure_bubble
from labkit.parallel.pipeline.config import PipelineConfig
from labkit.parallel.pipeline.simulate import simulate

TOL = 1e-5  # fp32 parity tolerance (DESIGN.md §4)
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
_REF: dict = {}

pytestmark = pytest.mark.distributed


def _reference(cfg: PipelineConfig) -> dict:
    key = (cfg.model_config, cfg.global_batch, cfg.steps, cfg.seed, cfg.lr)
    if key not in _REF:
        _REF[key] = pj.reference(cfg)
    return _REF[key]


def _assert_parity(result, cfg: PipelineConfig, outputs=None, losses=None) -> None:
    """Every rank's first-step gradients and final parameters, and the losses, equal the
    single-process reference of ``cfg`` (``outputs``/``losses``: a subset of the ranks)."""
    ref = _reference(cfg)
    outputs = result.outputs if outputs is None else outputs
    assert (result.losses if losses is None else losses) == pytest.approx(ref["losses"], abs=TOL)
    tied = cfg.model_config.tie_embeddings
    seen = set()
    for out in outputs:
        for name, g in out["grads"].items():
            ref_name = "tok_emb.weight" if (tied and name == "head.weight") else name
            diff = (g - ref["grads"][ref_name]).abs().max().item()
            assert diff < TOL, (name, diff)
            seen.add(ref_name)
        for name, p in out["state"].items():
            ref_name = "tok_emb.weight" if (tied and name == "head.weight") else name
            assert (p - ref["state"][ref_name]).abs().max().item() < TOL, name
    assert seen == set(ref["grads"]), set(ref["grads"]) ^ seen


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parity_with_single_process(cluster4, schedule, p, m):
    """Losses, first-step gradients and parameters after 2 AdamW steps = one process."""
    cfg = PipelineConfig(pp=p, microbatches=m, schedule=schedule, steps=2, global_batch=8,
                         return_grads=True, return_state=True, measure_memory=False)
    _assert_parity(cluster4.run(pj.pipeline_train, cfg), cfg)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_accumulation_equals_mean_loss_over_16_samples(cluster4, schedule):
    """2 stages, 4 microbatches, 2 accumulation steps: the gradient of the single-process
    mean loss over all 16 samples, no scale factor."""
    cfg = PipelineConfig(pp=2, microbatches=4, accum_steps=2, global_batch=16,
                         schedule=schedule, steps=2, return_grads=True, return_state=True,
                         measure_memory=False)
    _assert_parity(cluster4.run(pj.pipeline_train, cfg), cfg)


def test_untied_embeddings(cluster4):
    mc = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, tie_embeddings=False)
    cfg = PipelineConfig(model=mc, pp=4, microbatches=4, schedule="zb-h1", steps=2,
                         return_grads=True, return_state=True)
    _assert_parity(cluster4.run(pj.pipeline_train, cfg), cfg)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_same_losses_as_torch_pipelining(cluster4, schedule, p):
    cfg = PipelineConfig(pp=p, microbatches=4, schedule=schedule, steps=3,
                         return_grads=True, return_state=True, measure_memory=False)
    ours = cluster4.run(pj.pipeline_train, cfg)
    # impl="torch" makes pipeline_train hand over to torch.distributed.pipelining
    theirs = cluster4.run(pj.pipeline_train, cfg.replace(impl="torch"))
    assert {m["impl"] for m in theirs.metrics} == {"torch"}
    assert "peak_inflight" not in theirs.metrics[0]  # labkit's executor did not run
    assert ours.losses == pytest.approx(theirs.losses, abs=TOL)
    assert theirs.losses == pytest.approx(_reference(cfg)["losses"], abs=TOL)
    for a, b in zip(ours.outputs, theirs.outputs):
        for name, g in a["grads"].items():
            assert (g - b["grads"][name]).abs().max().item() < TOL, name


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_same_as_torch_multi_stage_schedules(cluster4, schedule):
    """labkit's interleaved 1F1B and ZB-V against torch's ScheduleInterleaved1F1B and
    ScheduleZBVZeroBubble on the same stages (untied: with the embedding and head tied on one
    rank, torch's ZBV gets the shared weight's gradient wrong), and both against one
    process: losses, and every rank's first-step gradients."""
    from labkit.parallel.pipeline.torch_jobs import torch_schedule_train

    mc = ModelConfig(n_layers=8, d_model=32, n_heads=4, seq_len=16, tie_embeddings=False)
    cfg = PipelineConfig(model=mc, pp=4, microbatches=4, schedule=schedule, steps=2,
                         return_grads=True, return_state=True, measure_memory=False)
    ours = cluster4.run(pj.pipeline_train, cfg)
    theirs = cluster4.run(torch_schedule_train, cfg)
    assert {m["impl"] for m in theirs.metrics} == {"torch"}
    _assert_parity(theirs, cfg)
    _assert_parity(ours, cfg)


def test_compute_regions_and_messages(cluster4):
    """Every F/B/W is a traced region with stage and microbatch; each boundary carries
    b·S·H·4 bytes per microbatch each way (claim C33), all through labkit.comm; a tied
    embedding adds one V·H·4-byte gradient exchange between the first and last rank."""
    cfg = PipelineConfig(pp=4, microbatches=4, schedule="zb-h1", steps=1, global_batch=8)
    r = cluster4.run(pj.pipeline_train, cfg)
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
    at most P (min(P − r, M) on rank r); the bytes scale with the count."""
    base = PipelineConfig(pp=4, microbatches=8, steps=1, global_batch=16)
    g = cluster4.run(pj.pipeline_train, base.replace(schedule="gpipe")).metrics
    o = cluster4.run(pj.pipeline_train, base.replace(schedule="1f1b")).metrics
    assert [m["peak_inflight"] for m in g] == [8, 8, 8, 8]
    assert [m["peak_inflight"] for m in o] == [4, 3, 2, 1]
    ratio = g[0]["peak_activation_bytes"] / o[0]["peak_activation_bytes"]
    assert ratio == pytest.approx(8 / 4, rel=0.02)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1", "zb-v"])
def test_measured_inflight_equals_the_schedules_count(cluster4, schedule):
    """The stage-microbatches whose saved tensors are alive at once, measured, equal the
    schedule's count (F start to BW/W end, independent of timing): a zero-bubble ``W``
    really keeps its stored inputs until it runs."""
    cfg = PipelineConfig(pp=4, microbatches=8, steps=1, global_batch=16, schedule=schedule)
    got = [m["peak_inflight"] for m in cluster4.run(pj.pipeline_train, cfg).metrics]
    assert got == simulate(cfg.build_schedule()).peak_inflight


def test_bubble_measured_beside_simulation(cluster4):
    """What does not depend on the clock: the report's structure, the unit-cost rung
    (3/7), the CPU times every span carries, a bubble between 0 and 1 that no replay of
    the run's own spans beats. (How close measured and simulated come is timing: see
    benchmarks/pipeline_bubble.py.)"""
    cfg = PipelineConfig(pp=4, microbatches=4, schedule="1f1b", steps=3)
    r = cluster4.run(pj.pipeline_train, cfg)
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


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-v"])
def test_two_pipelines_at_once_address_peers_by_global_rank(cluster4, schedule):
    """A 4-rank pool runs two 2-stage pipelines at the same time on the groups (0, 2) and
    (1, 3), each with its own seed (weights and data): each matches its own single-process
    reference on every rank, so no message (nor the tied-embedding exchange) went to the
    other pipeline."""
    from jobs_pipeline import concurrent_pipelines

    cfg = PipelineConfig(pp=2, microbatches=4, schedule=schedule, steps=2, global_batch=8,
                         measure_memory=False, timeout_s=60)
    r = cluster4.run(concurrent_pipelines, cfg, nranks=4)
    assert [o["pp_ranks"] for o in r.outputs] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    for d in (0, 1):
        mine = [o for o in r.outputs if o["dp"] == d]
        _assert_parity(r, cfg.replace(seed=d), mine, r.outputs[d]["losses"])
    assert r.outputs[0]["losses"] != pytest.approx(r.outputs[1]["losses"], abs=1e-3)


@pytest.mark.parametrize("changes,match", [
    (dict(global_batch=8, microbatches=3), r"global_batch=8 does not split into microbatches=3"),
    (dict(pp=4, schedule="interleaved", virtual_stages=4),
     r"pp x virtual_stages = 4 x 4 = 16 stages but the model has n_layers=8"),
    (dict(pp=2, schedule="interleaved", virtual_stages=3),
     r"virtual_stages=3 does not divide the 4 layers per rank"),
    (dict(schedule="pipedream"), r"unknown schedule 'pipedream'"),
    (dict(pp=8), r"pp=8 needs 8 ranks but the cluster has world_size=4"),
])
def test_bad_input_raises_before_launch(cluster4, changes, match):
    with pytest.raises(ValueError, match=match):
        cluster4.run(pj.pipeline_train, PipelineConfig().replace(**changes))
    assert cluster4.restarts == 0 or cluster4.alive
