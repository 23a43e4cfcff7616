"""One rank's memory under fake tensors and a fake process group
(:mod:`labkit.measure.fake_rank`).

* On a shard small enough to run for real, the fake measurement of every rank equals the
  real 4-rank job's tracked memory byte for byte (peak by category, model state, the marks
  up to the first forward): the same code allocated the same tensors.
* At cluster scale (Llama 3 405B, TP8 x PP14 x DP128 = 14,336 ranks, ZeRO-1, bf16, full
  recomputation), the measured model state equals the planner's to the byte (apart from
  Adam's 4-byte step counters) and the activations agree within the band stated in
  benchmarks/fake_rank_405b.py.
"""
from __future__ import annotations

import pytest
from jobs_fake_rank import read_corpus

from labkit import jobs
from labkit.config import ParallelConfig, RunConfig, preset
from labkit.measure.fake_rank import compare, fake_rank_memory, planned_rank_memory

TINY = dict(model="tiny", steps=1, global_batch=8, count_flops=False, measure_memory=True,
            precision="bf16", timeout_s=240)
SHARDS = {
    "dp2-tp2-zero1-sp": dict(parallel=ParallelConfig(dp=2, tp=2), zero_stage=1,
                             sequence_parallel=True),
    "tp2-pp2-full": dict(parallel=ParallelConfig(tp=2, pp=2), checkpoint="full"),
}


def _tiny(name: str) -> RunConfig:
    return RunConfig(**TINY, **SHARDS[name])


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SHARDS))
def test_fake_measurement_equals_the_real_job_on_every_rank(cluster4, name):
    cfg = _tiny(name)
    # a rank reads the corpus once per process; the fake measurement reads it beforehand
    cluster4.run(read_corpus, None)
    real = cluster4.run(jobs.train, cfg)
    assert len(real.metrics) == 4
    for m in real.metrics:
        fake = fake_rank_memory(cfg, m["rank"])
        assert fake["coords"] == m["coords"]
        want, got = m["memory"], fake["memory"]
        assert got["peak"] == want["peak"], (name, m["rank"])
        assert got["model_state"] == want["model_state"], (name, m["rank"])
        # the marks exist alike; their bytes after the backward are not compared: in the real
        # run a buffer's release can wait on gloo's background thread (seen: 26,752 bytes
        # still held at the "optimizer" mark in one run of four)
        assert [k for k, _ in got["timeline"]] == [k for k, _ in want["timeline"]]
        assert got["timeline"][:2] == want["timeline"][:2], (name, m["rank"])
        assert got["peak"]["activations"] > 0


def test_tiny_model_state_equals_the_planner():
    cfg = _tiny("dp2-tp2-zero1-sp")
    got = compare(fake_rank_memory(cfg, 1), planned_rank_memory(cfg, 1))
    assert got["parameters"]["measured"] == got["parameters"]["planned"]
    assert got["gradients"]["measured"] == got["gradients"]["planned"]
    # Adam's step counter: one 4-byte fp32 tensor per flat unit, which the planner leaves out
    units = got["optimizer"]["measured"] - got["optimizer"]["planned"]
    assert units > 0 and units % 4 == 0 and units <= 4 * 8


LLAMA_405B = RunConfig(model=preset("llama3-405b"), parallel=ParallelConfig(tp=8, pp=14, dp=128),
                       global_batch=128 * 16, zero_stage=1, precision="bf16",
                       sequence_parallel=True, checkpoint="full", count_flops=False,
                       timeout_s=3600)
#: |planned / measured - 1| for activations at this layout: -0.125 measured (the planner
#: counts one recomputed layer that the tracker files under "other", and labkit holds ~75 MB
#: per microbatch in flight beyond the layer inputs; labkit.measure.fake_rank's docstring)
ACTIVATION_BAND = 0.15


@pytest.mark.slow
def test_405b_rank_agrees_with_the_planner():
    cfg = LLAMA_405B
    assert cfg.parallel.world_size == 14336
    fake = fake_rank_memory(cfg, 0)
    assert fake["world_size"] == 14336 and fake["stages"] == [0]
    got = compare(fake, planned_rank_memory(cfg, 0))
    for c in ("parameters", "gradients"):
        assert got[c]["measured"] == got[c]["planned"], c
    assert 0 <= got["optimizer"]["measured"] - got["optimizer"]["planned"] <= 4 * 16
    assert abs(got["activations"]["error"]) <= ACTIVATION_BAND, got["activations"]


def test_refuses_a_rank_outside_the_world_and_a_live_process_group(monkeypatch):
    cfg = _tiny("dp2-tp2-zero1-sp")
    with pytest.raises(ValueError, match="rank must be in 0..3"):
        fake_rank_memory(cfg, 4)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised"):
        fake_rank_memory(cfg, 0)
