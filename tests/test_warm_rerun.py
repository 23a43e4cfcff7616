"""A warm rank's re-run of an unchanged config is the cold run, bit for bit
(:mod:`labkit.train.cache`): losses, every rank's parameters and first-step gradients,
torch's generator state afterwards, every measured byte and the trace's events (clock
readings aside), whether the rank reused its composed stages, copied its pristine model, or
built everything. And what the cache keeps is bounded and checked before it is reused."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from labkit.config import ModelConfig, RunConfig

pytestmark = pytest.mark.distributed

BASE = RunConfig(steps=3, global_batch=8, return_state=True, return_grads=True, timeout_s=180)
DEEP = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, name="deep4")
#: composition -> what a warm re-run takes from the cache
COMPOSITIONS = {
    "pp2 x dp2, 1f1b, tied embedding": (BASE.replace(dp=2, pp=2),
                                        {"stages", "p2p_latency_s"}),
    "dp2 x tp2, sequence parallel, full checkpointing": (
        BASE.replace(dp=2, tp=2, sequence_parallel=True, checkpoint="full"), {"stages"}),
    "pp2 x dp2, interleaved, two flushes": (
        BASE.replace(dp=2, pp=2, model=DEEP, schedule="interleaved", micro_batch=1,
                     microbatches=2), {"stages", "p2p_latency_s"}),
    # the zero-bubble store remembers the last microbatch it saw: the stages' structure
    # changed, so they are composed again (from the model copy)
    "pp2 x dp2, zb-h1": (BASE.replace(dp=2, pp=2, schedule="zb-h1"),
                         {"model", "p2p_latency_s"}),
    "zero-3 over dp4 (wrappers flatten the stages: the model is copied)": (
        BASE.replace(dp=4, zero_stage=3), {"model"}),
}
#: metrics that are clock readings or say where a value came from
CLOCK = {"step_time_s", "step_times", "mfu", "hfu", "peak_flops", "p2p_latency_s", "overlap",
         "reused", "peak_measured_at", "peak_age_s", "peak_conditions", "peak_source",
         "mfu_error"}


def _events(result, rank: int) -> Counter:
    return Counter((e.name, e.cat, e.op, e.bytes_sent, e.bytes_recv, e.axis, e.peers, e.step)
                   for e in result.trace.filter(rank=rank) if e.cat != "wait")


def assert_same_run(a, b) -> None:
    """``a`` and ``b`` ran the same thing on every rank: exact equality of everything but
    the clock."""
    assert len(a.outputs) == len(b.outputs)
    for r, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        assert x["losses"] == y["losses"], r
        assert x["rng"] == y["rng"], f"rank {r}: torch's generator state differs after the job"
        for part in ("state", "grads"):
            assert x[part].keys() == y[part].keys(), (r, part)
            for name in x[part]:
                assert torch.equal(x[part][name], y[part][name]), (r, part, name)
        mx = {k: v for k, v in x["metrics"].items() if k not in CLOCK}
        my = {k: v for k, v in y["metrics"].items() if k not in CLOCK}
        assert mx == my, r
        assert _events(a, r) == _events(b, r), r


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_a_warm_rerun_is_the_cold_run_bit_for_bit(cluster4, name):
    """Cold (the rank's cache of the job forgotten), then twice warm with, in between, a
    one-rank job of another seed (it must not disturb what the 4-rank runs reuse) and a job
    that draws random numbers on every rank (the generators must still end as a cold run
    leaves them)."""
    from jobs_warm import scramble_rng, train_cold, train_warm

    cfg, reused = COMPOSITIONS[name]
    cold = cluster4.run(train_cold, cfg)
    assert all(m["reused"] == [] for m in cold.metrics)
    warm = cluster4.run(train_warm, cfg)
    cluster4.run(train_warm, BASE.replace(seed=7))
    cluster4.run(scramble_rng)
    warm2 = cluster4.run(train_warm, cfg)
    assert [set(m["reused"]) for m in warm.metrics] == [reused] * 4
    # the one-rank job replaced rank 0's pristine model, not the 4-rank composition
    assert [set(m["reused"]) for m in warm2.metrics] == [reused - {"model"}] + [reused] * 3
    assert_same_run(cold, warm)
    assert_same_run(cold, warm2)


def test_the_comparison_sees_a_cache_that_forgets_to_restore(cluster4):
    """The planted bug: a re-run that reuses the stages without copying their composed
    values back trains from the last run's weights. The checks above must see it."""
    from jobs_warm import train_cold, train_unrestored

    cfg = COMPOSITIONS["pp2 x dp2, 1f1b, tied embedding"][0]
    cold = cluster4.run(train_cold, cfg)
    bad = cluster4.run(train_unrestored, cfg)
    assert all("stages" in m["reused"] for m in bad.metrics)
    with pytest.raises(AssertionError):
        assert_same_run(cold, bad)
    for x, y in zip(cold.outputs, bad.outputs):  # every rank trained from other weights
        assert any(not torch.equal(x["state"][n], y["state"][n]) for n in x["state"])


def test_stages_a_run_changed_are_composed_again(cluster4):
    """A forward hook left on a kept block (what a careless job could leave): the next run
    sees the stages' structure changed, composes them afresh, and is the cold run."""
    from jobs_warm import leave_a_hook, train_cold, train_warm

    cfg = COMPOSITIONS["pp2 x dp2, 1f1b, tied embedding"][0]
    cold = cluster4.run(train_cold, cfg)
    assert all(o["kept"] for o in cluster4.run(leave_a_hook, cfg).outputs)
    again = cluster4.run(train_warm, cfg)
    assert all("stages" not in m["reused"] for m in again.metrics)
    assert_same_run(cold, again)
    assert all("stages" in m["reused"] for m in cluster4.run(train_warm, cfg).metrics)


def test_the_cache_keeps_one_composition_per_world_size(cluster4):
    """Three configs on 4 ranks and one on 2: each rank keeps one model, one composition per
    world size it ran (ranks 2-3 never ran the 2-rank job), and the measurements of at most
    MEASURED_CONFIGS configs per world size."""
    from jobs_warm import cache_contents, train_cold, train_warm

    from labkit.train.cache import MEASURED_CONFIGS

    small = BASE.replace(steps=1, return_state=False, return_grads=False,
                         measure_memory=False, count_flops=False)
    cluster4.run(train_cold, small.replace(dp=2, pp=2))
    for i in range(MEASURED_CONFIGS + 1):
        cluster4.run(train_warm, small.replace(dp=2, pp=2, seed=i))
    cluster4.run(train_warm, small.replace(pp=2))
    kept = cluster4.run(cache_contents).outputs
    assert kept[0] == kept[1] == {"train.pristine_model": 1, "train.stages": 2,
                                  "train.measured": MEASURED_CONFIGS + 1}
    assert kept[2] == kept[3] == {"train.pristine_model": 1, "train.stages": 1,
                                  "train.measured": MEASURED_CONFIGS}
