"""User jobs that change what a training rank really holds or sends, by a known amount the
predictions cannot see (tests/test_measured.py). Importable by the ranks."""
from __future__ import annotations

import torch
from torch import nn

import labkit.train as lt
from labkit import comm


def train_with_extra(ctx, spec: dict) -> dict:
    """Run the training job ``spec["cfg"]`` with ``spec["param"]`` extra fp32 elements on the
    first stage (a parameter outside the optimizer, holding a gradient of the same size
    from before the step) and, after every step, one traced all-reduce of
    ``spec["reduce"]`` fp32 elements over the ``spec["axis"]`` group. Returns the job's
    output plus ``{"extra": {"param_bytes", "grad_bytes", "numel"}}``."""
    n_param, n_reduce, axis = spec.get("param", 0), spec.get("reduce", 0), spec.get("axis", "dp")
    build, make = lt.build_rank, lt.make_step
    added: list = []

    def build_rank(ctx_, cfg_, mg):
        setup = build(ctx_, cfg_, mg)
        if n_param:
            p = nn.Parameter(torch.zeros(n_param, device=ctx_.device))
            p.grad = torch.zeros_like(p)
            first = setup.stages[min(setup.stages)]
            first.register_parameter("labkit_test_extra", p)
            added.append(first)
        return setup

    def make_step(setup, *a, **k):
        inner = make(setup, *a, **k)
        if not n_reduce:
            return inner

        def step(s, mark):
            loss = inner(s, mark)
            comm.all_reduce(torch.ones(n_reduce, device=setup.device),
                            group=setup.mg.group(axis), axis=axis)
            return loss
        return step

    lt.build_rank, lt.make_step = build_rank, make_step
    try:
        out = lt.run(ctx, spec["cfg"])
    finally:
        lt.build_rank, lt.make_step = build, make
        for m in added:  # the stages stay cached on a warm rank: leave them as built
            del m.labkit_test_extra
    out["extra"] = {"param_bytes": 4 * n_param, "grad_bytes": 4 * n_param}
    return out
