"""A warm rank keeps nothing of a finished job (in-process checks of what the rank loop does
after each job; benchmarks/soak.py measures it over 200 runs on real ranks)."""
from __future__ import annotations

import gc
import weakref

import torch

from labkit.worker import job_hooks_removed, release_memory


def _job_with_a_module_hook():
    """What bucketed DDP and FSDP units do: a post-accumulate hook whose closure holds the
    module. Returns a weak reference to the module."""
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "ready": 0}

    def hook(_p):
        state["ready"] += 1

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    model(torch.ones(2, 4)).sum().backward()
    assert state["ready"] == 2
    return weakref.ref(model)


def test_torch_keeps_a_module_whose_post_accumulate_hook_holds_it():
    """Why the rank loop needs job_hooks_removed: the cycle runs through autograd's C++
    AccumulateGrad node, where Python's collector cannot see it."""
    ref = _job_with_a_module_hook()
    gc.collect()
    assert ref() is not None


def test_the_hooks_of_a_job_are_removed_when_it_ends():
    with job_hooks_removed():
        ref = _job_with_a_module_hook()
    release_memory()
    assert ref() is None
    # outside a job, registering works as torch's own method again
    assert torch.Tensor.register_post_accumulate_grad_hook.__qualname__.startswith("Tensor.")


def test_a_failing_job_loses_its_hooks_too():
    refs = []
    try:
        with job_hooks_removed():
            refs.append(_job_with_a_module_hook())
            raise RuntimeError("the job failed")
    except RuntimeError:
        pass
    gc.collect()
    assert refs[0]() is None
