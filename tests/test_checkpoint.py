"""Activation checkpointing: schedules as data, measured counts = closed forms (claim C17),
policies on the real GPT (gradients, RNG, reentrant caveat), activation memory per layer beside
the lecture formula (C18), HFU > MFU with recomputation (labkit's check: MFU counts
model FLOPs only, C21), A100→H100 as data (C23)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from labkit.config import PRESETS, ModelConfig
from labkit.measure.mfu import hardware_generation, mfu, roofline_mfu
from labkit.models import build_model
from labkit.parallel.checkpoint import (BIG_O, STRATEGIES, Action, Counts, formula_counts,
                                        make_schedule, simulate, sqrt_every)
from labkit.parallel.checkpoint.exec import run_schedule
from labkit.parallel.checkpoint.policy import POLICIES, apply_checkpoint_policy
from labkit.parallel.checkpoint.jobs import (CheckpointRunConfig, adjusted_layer_bytes,
                                             korthikanti_layer_bytes, layer_terms,
                                             measure_layer_activations, measure_policy,
                                             train_policy)

NS = (4, 8, 16, 32, 64)
GPT_CFG = ModelConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16, name="ckpt-test")


@pytest.fixture(autouse=True)
def one_thread():
    """The machine is shared: one intra-op thread keeps tiny ops from spinning."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cases(n):
    for s in STRATEGIES:
        if s in ("every", "segment"):
            for c in sorted({1, 3, sqrt_every(n), n // 4, n}):
                yield s, c
        else:
            yield s, None


# ------------------------------------------------------------------------ schedules (C17)

@pytest.mark.parametrize("n", NS)
def test_measured_counts_equal_the_closed_forms(n):  # claim C17
    for strategy, c in _cases(n):
        sched = make_schedule(strategy, n, c)
        want = formula_counts(strategy, n, c)
        got = run_schedule(sched, batch=2, hidden=8)
        assert got.counts == want, (strategy, n, c)
        assert got.peak_bytes == want.peak_units * 2 * 8 * 4
        sim = simulate(sched)
        assert sim.counts == want
        assert [s.alive for s in sim.steps] == [s.alive for s in got.steps]


def test_closed_forms_by_hand():
    assert formula_counts("none", 8) == Counts(8, 0, 0, 16)
    assert formula_counts("full", 8) == Counts(8, 28, 0, 3)            # N(N+1)/2 = 36 calls
    assert formula_counts("full", 8).layer_calls == 36
    assert formula_counts("every", 8, 3).layer_calls == 8 + 2 * 6 + 1  # q=2, r=1
    assert formula_counts("sqrt", 16) == formula_counts("every", 16, 4)
    assert formula_counts("segment", 8, 3) == Counts(8, 6, 0, 3 - 2 + 6)
    assert formula_counts("segment", 8, 4).peak_units == 2 - 2 + 8 + 1
    assert formula_counts("selective", 8) == Counts(8, 0, 8, 9)
    assert str(make_schedule("every", 4, 2)) == "F1 F2+ F3 F4* B4 R3* B3 D2 R1 R2* B2 R1* B1 D0"


def test_growth_follows_the_lecture_big_o():  # claim C17: slopes on a log-log plot
    def slope(strategy, key, every=lambda n: None):  # the closed forms are exact: go large
        ys = [getattr(formula_counts(strategy, n, every(n)), key) for n in (256, 4096)]
        return math.log(ys[1] / ys[0]) / math.log(16)

    assert slope("none", "layer_calls") == pytest.approx(1)
    assert slope("none", "peak_units") == pytest.approx(1)
    assert slope("full", "layer_calls") == pytest.approx(2, abs=0.1)      # O(N²)
    assert slope("full", "peak_units") == 0                               # O(1)
    assert slope("sqrt", "layer_calls") == pytest.approx(1.5, abs=0.1)    # O(N√N)
    assert slope("sqrt", "peak_units") == pytest.approx(0.5, abs=0.1)     # O(√N)
    k4 = lambda n: n // 4  # the lecture's C = 4 checkpoints: O(N²/C) compute, O(C) memory
    assert slope("every", "layer_calls", k4) == pytest.approx(2, abs=0.15)
    assert slope("every", "peak_units", k4) == 0
    assert slope("segment", "layer_calls", sqrt_every) == pytest.approx(1, abs=0.05)
    assert set(BIG_O) == set(STRATEGIES)


def test_schedules_are_data_and_the_simulator_checks_them():
    sched = make_schedule("segment", 8, 3)
    assert [str(Action.parse(c)) for c in sched.codes()] == sched.codes()
    assert Action.parse("R4e") == Action("recompute", 4, part="ew")
    bad = sched.__class__("none", 2, None, tuple(map(Action.parse, ["F1*", "B1"])))
    with pytest.raises(ValueError, match="not ready for backward"):
        simulate(bad)
    with pytest.raises(ValueError, match="input A_1 is not available"):
        simulate(sched.__class__("none", 2, None, (Action.parse("F2*"),)))
    with pytest.raises(ValueError, match="not ready for backward"):
        run_schedule(bad)
    with pytest.raises(ValueError):
        Action.parse("X3")


def test_every_strategy_gives_the_same_gradients():
    ref = run_schedule(make_schedule("none", 8), hidden=8)
    for strategy, c in _cases(8):
        got = run_schedule(make_schedule(strategy, 8, c), hidden=8)
        same = torch.equal if strategy != "selective" else (
            lambda a, b: torch.allclose(a, b, atol=1e-6))  # hand-written silu backward
        assert same(got.input_grad, ref.input_grad), strategy
        assert all(same(a, b) for a, b in zip(got.weight_grads, ref.weight_grads)), strategy


@pytest.mark.parametrize("call", [
    lambda: make_schedule("every", 8, 0), lambda: make_schedule("every", 8, 9),
    lambda: formula_counts("segment", 4, 5), lambda: make_schedule("nope", 4),
    lambda: make_schedule("none", 0), lambda: apply_checkpoint_policy(
        build_model(GPT_CFG), "every", every=5), lambda: apply_checkpoint_policy(
        build_model(GPT_CFG), "sometimes"), lambda: CheckpointRunConfig(
        model=GPT_CFG, policy="every", every=0).validate(),
    lambda: hardware_generation("A100", "H100-SXM"), lambda: mfu(1e9, 1.0, None, 1)])
def test_bad_input_is_a_clear_value_error(call):
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert any(w in msg for w in ("C=", "unknown", "n_layers", "GPU", "peak")), msg


def test_c_error_names_both_numbers():
    with pytest.raises(ValueError, match=r"C=9 with N=8"):
        make_schedule("every", 8, 9)
    with pytest.raises(ValueError, match=r"C=0 with N=4"):
        apply_checkpoint_policy(build_model(GPT_CFG), "every", every=0)


# ------------------------------------------------------------------------ GPT policies

def _grads(policy, every=1, dropout=0.0, preserve=True, reentrant=False):
    model = build_model(GPT_CFG, seed=0)
    if dropout:
        for b in model.layers:  # a dropout case: residual dropout after the MLP
            b.mlp = nn.Sequential(b.mlp, nn.Dropout(dropout))
    apply_checkpoint_policy(model, policy, every, preserve_rng_state=preserve,
                            use_reentrant=reentrant)
    idx = torch.randint(0, 256, (2, GPT_CFG.seq_len), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    loss = model(idx, idx)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_policies_give_bitwise_identical_gradients(dropout):
    ref_loss, ref = _grads("none", dropout=dropout)
    for policy, every in (("full", 1), ("every", 2), ("selective", 1)):
        loss, got = _grads(policy, every, dropout)
        assert torch.equal(loss, ref_loss), policy
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), policy


def test_without_rng_preservation_dropout_gradients_differ():
    _, ref = _grads("none", dropout=0.2)
    _, got = _grads("full", dropout=0.2, preserve=False)
    assert not all(torch.equal(a, b) for a, b in zip(got, ref))


def test_reentrant_without_grad_inputs_leaves_parameters_without_gradient_and_warns():
    model = build_model(GPT_CFG, seed=0)
    model.tok_emb.weight.requires_grad_(False)  # frozen (tied) embedding: blocks' input has no grad
    apply_checkpoint_policy(model, "full", use_reentrant=True)
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.warns(UserWarning, match="labkit: reentrant checkpoint of layers"):
        model(idx, idx).backward()
    assert all(p.grad is None for p in model.layers.parameters())  # as PyTorch documents
    assert model.norm.weight.grad is not None
    apply_checkpoint_policy(model, "full")  # non-reentrant: the blocks learn again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(idx, idx).backward()
    assert all(p.grad is not None for p in model.layers.parameters())


def test_policy_keeps_state_dict_and_can_be_undone():
    model = build_model(GPT_CFG, seed=0)
    keys = list(model.state_dict())
    for policy in POLICIES:
        apply_checkpoint_policy(model, policy, every=2)
        assert list(model.state_dict()) == keys
    apply_checkpoint_policy(model, "none")
    assert all("forward" not in vars(b) for b in model.layers)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        apply_checkpoint_policy(model, "selective", use_reentrant=True)


# ------------------------------------------------------------------ activation memory (C18)

@pytest.mark.parametrize("name,attention", [("tiny", "sdpa"), ("tiny", "math"),
                                            ("small", "sdpa")])
def test_activation_memory_per_layer_matches_the_adjusted_formula(name, attention):  # C18
    cfg = PRESETS[name]
    measured = measure_layer_activations(cfg, batch=2, attention=attention)
    adjusted = adjusted_layer_bytes(cfg, batch=2, attention=attention)
    assert abs(measured - adjusted) <= 0.05 * adjusted
    assert measured == adjusted  # exact, in fact
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_heads
    kd = cfg.kv_heads * cfg.head_dim
    assert adjusted == 4 * s * 2 * (6 * h + 2 * kd + 4 * cfg.ffn_dim + a + 2) \
        or attention == "math"
    lecture = korthikanti_layer_bytes(s, 2, h, a)
    assert lecture == s * 2 * h * (34 + 5 * a * s / h)
    assert abs(measured - lecture) > 0.05 * lecture  # the unadjusted formula does not fit
    assert sum(layer_terms(cfg, 2, attention=attention).values()) == adjusted


def test_block_measured_alone_equals_block_in_the_model():
    cfg = PRESETS["tiny"]
    assert measure_layer_activations(cfg, 1, in_model=False) == \
        measure_layer_activations(cfg, 1, in_model=True)


# ------------------------------------------------------------------------ MFU / HFU (C21, C23)

def test_full_checkpointing_raises_hfu_above_mfu():  # MFU of C21 vs hardware FLOPs
    out = {}
    for policy in ("none", "full", "selective"):
        cfg = CheckpointRunConfig(model=GPT_CFG, policy=policy, micro_batch=2, steps=2)
        out[policy] = measure_policy(cfg, peak_flops=1e11)["metrics"]
    none, full, sel = out["none"], out["full"], out["selective"]
    assert none["hfu"] == none["mfu"] and none["hardware_flops"] == none["model_flops"]
    assert full["model_flops"] == none["model_flops"]
    assert full["hardware_flops"] > full["model_flops"] and full["hfu"] > full["mfu"]
    # full recomputes every block's forward: + (forward share of the blocks) ≈ +1/3 of them
    assert 1.1 < full["hardware_flops"] / full["model_flops"] < 4 / 3
    assert full["model_flops"] < sel["hardware_flops"] < full["hardware_flops"]
    assert full["activation_bytes"] < sel["activation_bytes"] < none["activation_bytes"]


def test_a100_to_h100_as_data_and_why_mfu_can_fall():  # claim C23
    g = hardware_generation("A100-SXM4-40GB", "H100-SXM")
    assert math.floor(g["flops_ratio"] * 10) / 10 == 3.1
    assert math.floor(g["bandwidth_ratio"] * 10) / 10 == 2.1
    assert g["ridge_new"] > g["ridge_old"]
    from labkit.measure.peak import GPU_SPECS
    a, h = GPU_SPECS["A100-SXM4-40GB"], GPU_SPECS["H100-SXM"]
    work = (1e12, 5e9)  # FLOPs and bytes of memory-bound work per step
    assert roofline_mfu(*work, h["flops"]["bf16"], h["bandwidth"]) < \
        roofline_mfu(*work, a["flops"]["bf16"], a["bandwidth"])


def test_train_policy_job_on_the_cluster(cluster2):
    cfg = CheckpointRunConfig(model=GPT_CFG, policy="full", micro_batch=2, steps=2)
    res = cluster2.run(train_policy, cfg)
    for rank, m in enumerate(res.metrics):
        assert m["rank"] == rank and m["peak_flops"] > 0
        assert m["hfu"] > m["mfu"] > 0 and m["step_time_s"] > 0
        assert m["activation_bytes"] > 0 and m["peak_activation_bytes"] >= m["activation_bytes"]
