"""N-D composition on 8 ranks: three and four parallelisms at once through the one job,
each equal to single-process training (3 AdamW steps, losses and every rank's parameters
and first-step gradients within 1e-5), with every axis's bytes equal to its formula.

Eight ranks share two cores here, so these runs are few and small; every 2-way pair runs
on 2 or 4 ranks in tests/test_train.py."""
from __future__ import annotations

import pytest
from parity import assert_parity

from labkit import jobs
from labkit.config import ModelConfig, RunConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = RunConfig(steps=3, global_batch=8, return_state=True, return_grads=True,
                 measure_memory=False, count_flops=False, timeout_s=240, adam_eps=1e-6)
UNTIED = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, tie_embeddings=False,
                     name="tiny-untied")
ND = {
    "dp2-tp2-pp2": dict(dp=2, tp=2, pp=2),
    "tp2-cp2-dp2": dict(tp=2, cp=2, dp=2),
    "zero3-tp2-pp2": dict(dp=2, tp=2, pp=2, zero_stage=3),
    "ep2-dp2-tp2": dict(model="tiny-moe", dp=4, ep=2, tp=2),
}


@pytest.mark.parametrize("name", list(ND))
def test_nd_parity_eight_ranks(cluster8, name):
    cfg = BASE.replace(**ND[name])
    assert cfg.parallel.world_size == 8
    r = cluster8.run(jobs.train, cfg)
    assert_parity(r, cfg)
    for m in r.metrics:
        for axis, want in m["comm_predicted_by_axis"].items():
            got = {k: v for k, v in m["comm_bytes_by_axis"].get(axis, {}).items() if v}
            assert got == want, (name, axis, m["rank"])
