"""ZeRO-1/2/3, FSDP and HSDP (issue 4): parity with one process, plain DP and PyTorch FSDP2;
the mean-not-sum check; bytes equal to the formulas exactly; memory within 5 % of the plan;
prefetch overlap; bad input. Claims C10, C13–C16."""
from __future__ import annotations

import statistics

import pytest
import torch
from jobs_for_tests import mean_of_two_rows_gradient

from labkit.config import RunConfig
from labkit.parallel.zero_config import ZeroConfig
from labkit.parallel.zero_jobs import overlap_fraction, zero_gradients, zero_train
from labkit.plan.comm import dp_step_comm_bytes
from labkit.plan.memory import model_state_bytes
from labkit.train import reference

pytestmark = pytest.mark.distributed

TOL = 1e-5  # fp32 parity (DESIGN.md §4)
RUN = RunConfig(steps=3, global_batch=8, measure_memory=False, count_flops=False,
                return_state=True, timeout_s=60)
_REF: dict = {}
_RUNS: dict = {}


def _reference():
    if "ref" not in _REF:
        _REF["ref"] = reference(RUN)
    return _REF["ref"]


def _run(cluster, cfg: ZeroConfig):
    if cfg not in _RUNS:
        _RUNS[cfg] = cluster.run(zero_train, cfg)
    return _RUNS[cfg]


def _global_losses(r):
    n = len(r.outputs)
    return [sum(o["losses"][s] for o in r.outputs) / n for s in range(len(r.outputs[0]["losses"]))]


def _zc(**kw) -> ZeroConfig:
    return ZeroConfig(run=RUN).replace(**kw)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_with_single_process_and_dp(cluster4, stage, dp):
    """C13–C15: every stage trains exactly like one process and like plain DP."""
    ref = _reference()
    r = _run(cluster4, _zc(zero_stage=stage, dp=dp))
    dp_run = _run(cluster4, _zc(zero_stage=0, dp=dp))
    assert _global_losses(r) == pytest.approx(ref["losses"], abs=TOL)
    assert _global_losses(r) == pytest.approx(_global_losses(dp_run), abs=TOL)
    state = r.outputs[0]["state"]
    assert (state - ref["state"]).abs().max().item() < TOL
    assert (state - dp_run.outputs[0]["state"]).abs().max().item() < TOL
    assert r.outputs[0]["losses"] != pytest.approx(r.outputs[1]["losses"])  # real shards


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_accumulation_parity(cluster4, stage):
    """Two microbatches per rank: stage 1 reduces once, stages 2-3 once per microbatch."""
    ref = _reference()
    r = _run(cluster4, _zc(zero_stage=stage, dp=2, micro_batch=2))
    assert _global_losses(r) == pytest.approx(ref["losses"], abs=TOL)
    assert (r.outputs[0]["state"] - ref["state"]).abs().max().item() < TOL
    m = r.metrics[0]
    assert m["comm_bytes_by_op"] == m["comm_predicted_by_op"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hsdp_2x2_parity(cluster4, stage):
    """C16: 2 replica groups x 2 shards equals one process."""
    ref = _reference()
    r = _run(cluster4, _zc(zero_stage=stage, dp=4, hsdp_replicas=2))
    assert _global_losses(r) == pytest.approx(ref["losses"], abs=TOL)
    assert (r.outputs[0]["state"] - ref["state"]).abs().max().item() < TOL
    assert r.metrics[0]["shards"] == 2 and r.metrics[0]["replicas"] == 2


@pytest.mark.parametrize("dp,replicas", [(2, 1), (4, 2)])
def test_equals_pytorch_fsdp2(cluster4, dp, replicas):
    """labkit FSDP = FSDP2 ``fully_shard`` (1-D mesh), labkit HSDP = FSDP2 on a 2-D
    (replicate, shard) DeviceMesh, same model and batches."""
    ours = _run(cluster4, _zc(zero_stage=3, dp=dp, hsdp_replicas=replicas))
    theirs = _run(cluster4, _zc(zero_stage=3, dp=dp, hsdp_replicas=replicas, impl="torch"))
    assert _global_losses(ours) == pytest.approx(_global_losses(theirs), abs=TOL)
    diff = (ours.outputs[0]["state"] - theirs.outputs[0]["state"]).abs().max().item()
    assert diff < TOL, diff


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_is_mean_not_sum(cluster4, stage):
    """World 2, one different row per rank: the reduced gradient equals the single-process
    gradient of the mean over both rows (a sum would be 2x)."""
    out = cluster4.run(zero_gradients, stage, nranks=2).outputs
    ref = mean_of_two_rows_gradient()
    for o in out:
        assert torch.allclose(o["weight"], ref["weight"], atol=1e-6)
        assert torch.allclose(o["bias"], ref["bias"], atol=1e-6)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage,keep_last", [(0, True), (1, True), (2, True), (3, False),
                                             (3, True)])
def test_bytes_equal_formula_exactly(cluster4, stage, keep_last, dp):
    """C9/C13/C14/C15: DP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ, × (N−1)/N × 4 bytes, from the trace."""
    r = _run(cluster4, _zc(zero_stage=stage, dp=dp, keep_last=keep_last))
    for rank, m in enumerate(r.metrics):
        n = m["n_params"]
        formula = {0: 2, 1: 2, 2: 2, 3: 3}[stage] * (dp - 1) / dp * n * 4
        assert m["comm_bytes_predicted"] == formula == dp_step_comm_bytes(n, dp, 4, stage)
        assert m["padding_elems"] == 0
        assert m["comm_bytes_by_op"] == m["comm_predicted_by_op"]
        measured = r.trace.comm_bytes(rank, step=1)
        assert measured == m["comm_bytes_per_step"]
        assert measured + m["comm_saved_keep_last"] == formula
        assert (m["comm_saved_keep_last"] > 0) == (stage == 3 and keep_last)


def test_zero3_costs_50_percent_more_zero1_is_free(cluster4):
    """C13, C15 from real counts: ZeRO-1 moves what DP moves, ZeRO-3 1.5x that."""
    b = {s: _run(cluster4, _zc(zero_stage=s, dp=4, keep_last=False)).metrics[0]
         ["comm_bytes_per_step"] for s in (0, 1, 3)}
    assert b[1] == b[0]
    assert b[3] == 1.5 * b[1]


def test_hsdp_bytes(cluster4):
    """HSDP 2x2: FSDP traffic over K=2 plus an all-reduce of the Ψ/2 gradient shard over M=2."""
    m = _run(cluster4, _zc(zero_stage=3, dp=4, hsdp_replicas=2)).metrics[0]
    assert m["comm_bytes_by_op"] == m["comm_predicted_by_op"]
    assert m["comm_bytes_by_op"]["all_reduce"] == 2 * (1 / 2) * (m["n_params"] / 2) * 4


MEM_CASES = [dict(zero_stage=s, dp=2) for s in (0, 1, 2, 3)] + [
    dict(zero_stage=3, dp=4, hsdp_replicas=2), dict(zero_stage=3, dp=2, prefetch=False),
    dict(zero_stage=2, dp=2, mixed_precision=True),
    dict(zero_stage=3, dp=2, mixed_precision=True)]


@pytest.mark.parametrize("case", MEM_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_memory_measured_beside_prediction(cluster4, case):
    """C10: DP 16Ψ; ZeRO-1 4Ψ+12Ψ/N; ZeRO-2 2Ψ+14Ψ/N; ZeRO-3 16Ψ/N (mixed precision) and
    their fp32 equivalents, measured by MemTracker per category, within 5 %. The working
    set (gathered units, in-flight unit gradients) is named beside it."""
    cfg = _zc(**case).replace(measure_memory=True, return_state=False)
    r = cluster4.run(zero_train, cfg)
    for m in r.metrics:
        n, k = m["n_params"], m["shards"]
        pred = model_state_bytes(n, k, cfg.zero_stage, mixed_precision=cfg.mixed_precision)
        assert m["memory_predicted"] == {c: int(v) for c, v in pred.items()}
        measured = m["memory"]["model_state"]
        for cat in ("parameters", "gradients", "optimizer"):
            assert measured[cat] == pytest.approx(pred[cat], rel=0.05), cat
        ws = m["memory"]["working_set"]
        if cfg.zero_stage >= 2:  # a full gradient vector never exists
            elem = 2 if cfg.mixed_precision else 4
            assert 0 < ws["inflight_unit_grads"] < n * elem
        if cfg.zero_stage == 3:
            assert ws["gathered_units"] == ws["gathered_units_predicted"]
        assert m["memory"]["peak_total"] == sum(m["memory"]["peak"].values())


def test_mixed_precision_tracks_fp32(cluster4):
    """bf16 parameters/gradients, fp32 master + Adam: close to the fp32 run, half the bytes."""
    ref = _reference()
    r = _run(cluster4, _zc(zero_stage=3, dp=2, mixed_precision=True))
    assert _global_losses(r) == pytest.approx(ref["losses"], abs=5e-3)
    m = r.metrics[0]
    assert m["comm_bytes_predicted"] == dp_step_comm_bytes(m["n_params"], 2, 2, 3)


def test_prefetch_hides_all_gather(cluster4):
    """C15: with prefetch, part of the all-gather time is hidden under compute; without it
    the compute thread waits for every all-gather."""
    def mean_overlap(prefetch):
        r = cluster4.run(zero_train, _zc(zero_stage=3, dp=2, prefetch=prefetch, steps=5,
                                         return_state=False))
        vals = [overlap_fraction(r.trace.events, s, rank)["total"]
                for s in range(1, 5) for rank in range(2)]
        return statistics.median(vals)
    off, on = mean_overlap(False), mean_overlap(True)
    # off is ~0 by construction (issue, then wait at once); only preemption between the
    # two on a loaded machine shows as "hidden"
    assert off < 0.2, off
    assert on > off + 0.05, (on, off)


@pytest.mark.parametrize("kw,match", [
    (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3, got 4"),
    (dict(zero_stage=-1), "got -1"),
    (dict(zero_stage=3, dp=4, hsdp_replicas=3), r"hsdp_replicas=3 do not divide .* dp=4"),
    (dict(zero_stage=3, dp=3), r"shard count K = dp/hsdp_replicas = 3/1 = 3 does not divide "
                               r"the world size 4"),
    (dict(zero_stage=2, impl="torch"), "zero_stage=2"),
])
def test_bad_input_raises_before_launch(cluster4, kw, match):
    with pytest.raises(ValueError, match=match):
        cluster4.run(zero_train, _zc(**kw))
