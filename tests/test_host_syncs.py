"""No host read of a device value inside a training step (a GPU sync each), in every dense
composition family — counted on the CPU with :mod:`tests.host_syncs` (fake tensors, fake
process group, one rank of the layout in this process).

The reads that remain are named: ``find_unused``'s used-parameter map is read by the host
after its all-reduce (torch's DDP copies its map to the host too), and expert parallelism's
all-to-all needs its split sizes on the host (not run here: routing under fake tensors has
no values). torch's AdamW reads its step counters, which live on the host unless the
optimizer is fused or capturable: those reads are not of device values and are not counted.
"""
import pytest

import labkit as lk

from host_syncs import step_syncs

P = lk.ParallelConfig
_TINY = dict(model="tiny", global_batch=8)

# each layout composes several families, so that one process run covers them; the last
# rank holds the last pipeline stage (the loss) and the last shard of every axis
CASES = {
    "dp2 x tp2 sp x pp2 1f1b (2 flushes), ZeRO-1, checkpoint full":
        lk.RunConfig(**_TINY, parallel=P(dp=2, tp=2, pp=2), sequence_parallel=True,
                     schedule="1f1b", microbatches=2, zero_stage=1, precision="fp32",
                     checkpoint="full"),
    "dp2 x cp2 ulysses, ZeRO-3, 2 microbatches":
        lk.RunConfig(**_TINY, micro_batch=2, parallel=P(dp=2, cp=2), cp_method="ulysses",
                     zero_stage=3),
    "dp2 ddp bf16, 2 microbatches": lk.RunConfig(**_TINY, micro_batch=2, parallel=P(dp=2),
                                                  precision="bf16"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_reads_no_device_value(name):
    cfg = CASES[name]
    got = step_syncs(cfg, rank=cfg.parallel.world_size - 1)
    assert got["per_step"] == [0], (name, got)


def test_find_unused_reads_its_used_map_once_per_wrapper():
    got = step_syncs(lk.RunConfig(**_TINY, parallel=P(dp=2), find_unused=True), rank=1)
    assert got["per_step"][0] > 0
    assert got["where"] and all(w.startswith("parallel/dp/ddp.py") for w in got["where"]), got
