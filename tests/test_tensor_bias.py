"""Biases survive tensor parallelism: ``ColumnParallelLinear.from_linear`` splits the bias
with the output features, ``RowParallelLinear.from_linear`` adds it once after the
reduction (after the reduce-scatter with sequence parallelism) with its gradient not divided
by tp and, under SP, summed over the tp ranks' sequence shards. Every rank's output, input
gradient and weight and bias gradients equal one process's ``nn.Linear`` pair."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

CASES = [(2, 2, False), (2, 2, True), (4, 2, False), (4, 2, True), (4, 4, False), (4, 4, True)]


@pytest.mark.parametrize("world,tp,sp", CASES,
                         ids=[f"ranks{w}-tp{t}-{'sp' if s else 'nosp'}" for w, t, s in CASES])
def test_biased_linears_match_one_process_on_every_rank(cluster2, cluster4, world, tp, sp):
    cluster = cluster2 if world == 2 else cluster4
    outs = cluster.run("jobs_tensor:biased_pair", dict(tp=tp, sp=sp), timeout_s=60).outputs
    assert len(outs) == world
    for rank, out in enumerate(outs):
        for name, (got, want) in out.items():
            assert got is not None, (rank, name)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")

