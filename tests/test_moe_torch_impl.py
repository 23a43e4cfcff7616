"""A mixture-of-experts model under ``impl="torch"`` (PyTorch's DDP and FSDP2).

Both average gradients over the data ranks, so the job multiplies each forward's objective
by the data ranks first. That must hold for the load-balancing loss as for the token loss:
the first step's reduced gradients (before AdamW, which would hide a uniform scale but not
this partial one) equal labkit's own data parallelism and one process on every rank.
Expert parallelism under ``impl="torch"`` is refused before launch: PyTorch's wrappers
take every parameter as replicated, and under ``ep`` each rank holds different experts.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit import jobs
from labkit.config import PRESETS, RunConfig
from labkit.train import reference

# a large aux weight, so a misscaled load-balancing term moves the router gradient far
# beyond the 1e-6 it is compared at
MOE = dataclasses.replace(PRESETS["tiny-moe"], aux_loss_weight=0.5, name="tiny-moe-aux0.5")
BASE = RunConfig(model=MOE, steps=1, global_batch=4, return_grads=True,
                 measure_memory=False, count_flops=False).replace(dp=2)
ROUTERS = [f"layers.{i}.mlp.router.weight" for i in range(MOE.n_layers)]


@pytest.fixture(scope="module")
def one_process():
    return reference(BASE)["grads"]


@pytest.mark.parametrize("impl,zero", [("torch", 0), ("torch", 3), ("labkit", 0)],
                         ids=["torch-ddp", "torch-fsdp2", "labkit-dp"])
def test_first_step_gradients_equal_one_process_on_every_rank(cluster2, one_process, impl,
                                                              zero):
    r = cluster2.run(jobs.train, BASE.replace(impl=impl, zero_stage=zero))
    for out in r.outputs:                                     # every rank
        grads = out["grads"]
        assert set(grads) == set(one_process)
        for name in ROUTERS:
            assert one_process[name].abs().max() > 1e-3
            torch.testing.assert_close(grads[name], one_process[name], atol=1e-6, rtol=0)
        for name, want in one_process.items():
            torch.testing.assert_close(grads[name], want, atol=1e-5, rtol=0)


def test_expert_parallel_is_refused_under_impl_torch():
    for zero in (0, 3):
        cfg = BASE.replace(impl="torch", ep=2, zero_stage=zero)
        with pytest.raises(ValueError, match=r"impl='torch' with ep=2.*2 of the 4 experts"):
            cfg.validate(2)
    BASE.replace(impl="torch").validate(2)                   # ep=1 stays accepted
