"""Data parallelism in the one training job: exact bytes (also with gradient accumulation),
overlap of buckets with backward, memory exactly as planned, FLOPs exactly as the formula,
the ViT, checkpointing, unused parameters. Claims C8–C10, C21. Parity: tests/test_train.py."""
from __future__ import annotations

import pytest
import torch
from parity import assert_parity

from labkit import jobs
from labkit.config import RunConfig
from labkit.measure.flops import transformer_flops_per_token

pytestmark = pytest.mark.distributed

FAST = RunConfig(steps=2, global_batch=8, measure_memory=False, count_flops=False)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("mode,impl", [("ddp", "labkit"), ("naive", "labkit"), ("ddp", "torch")])
@pytest.mark.parametrize("micro", [None, 1])
def test_allreduce_bytes_equal_formula_exactly(cluster4, dp, mode, impl, micro):
    """C9: 2(N−1)/N·|θ|·4 bytes per rank per step, from every rank's trace, exactly — also
    with gradient accumulation, which must not sync the intermediate microbatches."""
    cfg = FAST.replace(dp=dp, dp_mode=mode, impl=impl, micro_batch=micro, bucket_mb=0.1
                       if mode == "ddp" else FAST.bucket_mb)
    r = cluster4.run(jobs.train, cfg)
    n = r.metrics[0]["n_params"]
    want = 2 * (dp - 1) / dp * n * 4
    for rank, m in enumerate(r.metrics):
        for step in range(2):
            assert r.trace.comm_bytes(rank, op="all_reduce", step=step) == want
        assert m["comm_bytes_by_axis"] == {"dp": {"all_reduce": want}}
        assert m["comm_predicted_by_axis"] == {"dp": {"all_reduce": want}}


def test_bucketing_overlaps_backward(cluster4):
    cfg = FAST.replace(dp=2, bucket_mb=0.01)
    r = cluster4.run(jobs.train, cfg)
    for rank in range(2):
        ev = r.trace.filter(rank=rank, step=1)
        backward = next(e for e in ev if e.name == "backward")
        buckets = [e for e in ev if e.op == "all_reduce"]
        assert len(buckets) > 3  # small buckets: several launches per step
        assert any(e.start < backward.end for e in buckets), "no bucket launched in backward"


@pytest.mark.parametrize("kw", [dict(dp=2), dict(dp=2, micro_batch=2), dict(pp=2),
                                dict(dp=2, pp=2)], ids=str)
def test_memory_exactly_as_planned(cluster4, kw):
    """C10 in fp32: parameters 4Ψ and gradients 4Ψ exactly; Adam's state 8Ψ plus a 4-byte
    step counter per parameter tensor, exactly — on every rank (Ψ: the rank's stages)."""
    cfg = RunConfig(steps=2, count_flops=False).replace(**kw)
    r = cluster4.run(jobs.train, cfg)
    for m in r.metrics:
        got, want = m["memory"]["model_state"], m["memory_predicted"]
        assert got["parameters"] == want["parameters"] == 4 * m["rank_params"]
        assert got["gradients"] == want["gradients"]
        # the prediction counts AdamW's 4-byte step counter per tensor: 8Ψ + 4·tensors
        assert got["optimizer"] == want["optimizer"] == 8 * m["rank_params"] \
            + 4 * m["optimizer_state_tensors"]
        assert m["memory"]["peak"]["activations"] > 0
        assert m["memory"]["peak_total"] == sum(m["memory"]["peak"].values())


@pytest.mark.parametrize("kw", [dict(dp=2), dict(dp=2, micro_batch=1)], ids=str)
def test_flops_equal_the_formula_exactly_and_mfu_is_reported(cluster4, kw):
    """C21: torch's counter (with the SDPA formula registered) equals 6·N + the
    non-causal attention term per token, exactly (SDPA computes the masked half too), and
    so does the job's analytic count, defined the same way."""
    cfg = RunConfig(steps=2).replace(**kw)
    r = cluster4.run(jobs.train, cfg)
    mc = cfg.model_config
    exact = transformer_flops_per_token(mc, causal=False)["total"] * cfg.local_batch * mc.seq_len
    for m in r.metrics:
        assert m["flops_per_step"] == exact
        assert m["flops_analytic"] == exact
        assert m["peak_flops"] > 0 and 0 < m["mfu"] < 1


@pytest.mark.parametrize("mode", ["ddp", "naive"])
def test_unused_parameter_is_named_not_hung(cluster2, mode):
    """Every rank raises, naming the parameter, and none waits in a collective (the run
    would time out); read per rank with ``error_of``, so the pool needs no restart."""
    errors = cluster2.run("jobs_for_tests:error_of", ("jobs_for_tests:two_heads",
                                                     (mode, False)), timeout_s=30).outputs
    assert len(errors) == 2 and all(e is not None and e["type"] == "RuntimeError"
                                    and "head_b" in e["message"] for e in errors), errors
    grads = cluster2.run("jobs_for_tests:two_heads", (mode, True), timeout_s=30).outputs
    # no rank used it: grad stays None on every rank, as torch DDP's find_unused_parameters
    assert all(g["head_b.weight"] is None and g["head_b.bias"] is None for g in grads)
    assert torch.equal(grads[0]["body.weight"], grads[1]["body.weight"])


def test_vit_on_digits_parity(cluster4):
    """The second real model: a ViT on scikit-learn's digits, dp=4 vs one process."""
    cfg = RunConfig(model="vit-digits", dataset="digits", steps=3, return_state=True,
                    return_grads=True, measure_memory=False, count_flops=False).replace(dp=4)
    assert_parity(cluster4.run(jobs.train, cfg), cfg)


def test_checkpointing_changes_flops_not_results(cluster4):
    """Recomputation changes the FLOPs run (HFU > MFU on every rank), not the result."""
    cfg = RunConfig(steps=3, return_state=True, measure_memory=False,
                    checkpoint="full").replace(dp=2)
    r = cluster4.run(jobs.train, cfg)
    assert_parity(r, cfg)
    for m in r.metrics:
        assert m["hardware_flops_per_step"] > m["flops_per_step"]
        assert m["hfu"] > m["mfu"]


@pytest.mark.parametrize("steps", [1, 2])
def test_memory_is_measured_in_a_real_step_even_for_short_runs(cluster4, steps):
    cfg = RunConfig(steps=steps, count_flops=False).replace(dp=2)
    r = cluster4.run(jobs.train, cfg)
    for m in r.metrics:
        assert m["memory"]["peak"]["activations"] > 0
        assert m["memory"]["model_state"]["gradients"] == m["memory_predicted"]["gradients"]
        assert m["step_time_s"] > 0
    # the tracked step is marked in the trace, so a timeline can say it is instrumented
    last = r.trace.filter(rank=0, step=steps - 1)
    assert last and all(e.args.get("instrumented") == "memory" for e in last)
