"""Parity with one process: the check every composition of the training job must pass.

``assert_parity(result, cfg)`` compares a cluster run of :func:`labkit.jobs.train` (run with
``return_state=True``, optionally ``return_grads=True``) against
:func:`labkit.train.reference` on the same config: the global losses of every step, and on
EVERY rank each parameter it holds (full shape, by full-model name) after training and each
reduced gradient of the first step. Every reference parameter must be held by some rank.
"""
from __future__ import annotations

from labkit.train import reference

TOL = 1e-5  # fp32 parity (DESIGN.md §4)
_REF: dict = {}


def cached_reference(cfg) -> dict:
    """The single-process reference, cached per (model, batch, steps, seed, lr, wd)."""
    key = (cfg.model_config, cfg.global_batch, cfg.steps, cfg.seed, cfg.lr, cfg.weight_decay,
           cfg.adam_eps, cfg.dataset)
    if cfg.model_config.n_experts:  # the load-balancing loss is per (data rank, microbatch)
        key += (cfg.parallel.dp, cfg.micro, cfg.parallel.cp, cfg.cp_zigzag)
    if key not in _REF:
        _REF[key] = reference(cfg)
    return _REF[key]


def worst_differences(result, cfg) -> dict:
    """``{"loss", "state", "grads"}``: the largest absolute difference over steps, ranks
    and parameters (``grads`` only when returned), plus ``"missing"`` parameter names."""
    ref = cached_reference(cfg)
    out = {"loss": max(abs(a - b) for a, b in zip(result.losses, ref["losses"]))}
    for o in result.outputs:
        assert o["losses"] == result.losses, "every rank reports the same global losses"
    held = set()
    for key in ("state", "grads"):
        if not all(key in o for o in result.outputs):
            continue
        worst = 0.0
        for o in result.outputs:
            for name, t in o[key].items():
                want = ref[key][name]
                assert t.shape == want.shape, (name, t.shape, want.shape)
                worst = max(worst, (t - want).abs().max().item())
                held.add(name)
        out[key] = worst
    out["missing"] = sorted(set(ref["state"]) - held)
    return out


def assert_parity(result, cfg, tol: float = TOL) -> dict:
    d = worst_differences(result, cfg)
    assert len(result.losses) == cfg.steps
    assert d["loss"] < tol, d
    assert d.get("state", 0.0) < tol, d
    assert d.get("grads", 0.0) < tol, d
    assert not d["missing"], d
    return d
