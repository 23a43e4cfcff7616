"""Every tensor of a training step on the rank's device, and no value of it read by the
host, for every composition family the ``meta`` device can run (:mod:`tests.device_placement`;
one rank per layout, one process). On a GPU each host read (``.item()``, ``float(t)``,
``.tolist()``) makes the host wait for every queued kernel; on ``meta`` it raises, so a
step that passes here reads none. ``find_unused`` reads its used-parameter map by design
(torch's DDP copies its map to the host too): asserted below, by the place it raises.

Not run on ``meta``, and why: expert parallelism (routing counts tokens per expert with
``bincount``, which has no ``meta`` kernel: its output size depends on values), bf16
(autocast has no ``meta`` device), ``impl="torch"`` (torch's DDP reads values while it
builds, FSDP2 asks the device module for its current device). Those wait for a GPU.
"""
import pytest

import labkit as lk

from device_placement import cpu_tensors_in_step

P = lk.ParallelConfig
_TINY = dict(model="tiny", global_batch=8)

CASES = {
    "dp2 x tp2 sp x pp2 1f1b, ZeRO-1, checkpoint full":
        lk.RunConfig(**_TINY, micro_batch=2, parallel=P(dp=2, tp=2, pp=2),
                     sequence_parallel=True, schedule="1f1b", zero_stage=1, checkpoint="full"),
    "dp2 x cp2 ring zigzag, ZeRO-3":
        lk.RunConfig(**_TINY, micro_batch=2, parallel=P(dp=2, cp=2), cp_method="ring",
                     cp_zigzag=True, zero_stage=3),
    "dp2 x cp2 ulysses, ddp, 2 microbatches":
        lk.RunConfig(**_TINY, micro_batch=2, parallel=P(dp=2, cp=2), cp_method="ulysses"),
    "pp2 zero-bubble": lk.RunConfig(**_TINY, parallel=P(pp=2), schedule="zb-h1"),
    "HSDP 2x2, ZeRO-2": lk.RunConfig(**_TINY, parallel=P(dp=4), zero_stage=2, hsdp_replicas=2),
    "ViT dp2": lk.RunConfig(model="vit-digits", global_batch=8, dataset="digits",
                            parallel=P(dp=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_makes_no_tensor_off_the_rank_device(name):
    cfg = CASES[name]
    got = cpu_tensors_in_step(cfg, rank=cfg.parallel.world_size - 1)
    assert got["devices"] == {"meta"}, got
    assert got["cpu_ops"] == [], (name, got["cpu_ops"])


def test_find_unused_reads_its_used_map_on_the_host():
    cfg = lk.RunConfig(**_TINY, parallel=P(dp=2), find_unused=True)
    with pytest.raises(RuntimeError, match="meta") as err:
        cpu_tensors_in_step(cfg, rank=1)
    frames = [f for f in err.traceback if "/labkit/" in str(f.path)]
    assert str(frames[-1].path).endswith("parallel/dp/ddp.py"), frames[-1]
