"""Tensor and sequence parallelism: parity with one process and with PyTorch's
``parallelize_module`` on every rank; the vocab-parallel cross-entropy against
``F.cross_entropy``; planted bugs that the parity checks catch; bytes per block equal to the
formulas exactly (C24–C26); model-state and activation memory beside C18; TP vs PP traffic
(C33); bad input before launch. Claims C18, C24–C27, C33."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from jobs_tensor import (CECase, TPRun, ce_check, ce_inputs, reference, tp_hooks, tp_measure,
                         tp_train)

from labkit.config import ModelConfig
from labkit.parallel.tensor import apply_tensor_parallel, check_tensor_parallel
from labkit.parallel.tensor.activations import block_activation_formula, lecture_activation_bytes
from labkit.parallel.tensor.measure import (block_bytes_formula, block_weight_grad_bytes,
                                            tp_bytes_by_layer, tp_state_bytes_formula,
                                            tp_vs_pp_bytes)

pytestmark = pytest.mark.distributed

TOL = 1e-5  # fp32 parity (DESIGN.md §4)
V = 37      # divides by neither 2 nor 4: the vocabulary is padded


def _model(kv: int, tied: bool = True, **kw) -> ModelConfig:
    return ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=kv, vocab_size=V,
                       seq_len=16, tie_embeddings=tied, **kw)


def _cluster(request, n: int):
    return request.getfixturevalue("cluster2" if n <= 2 else "cluster4")


_REFS: dict = {}


def _reference(run: TPRun) -> dict:
    key = (run.model, run.steps, run.batch, run.seq, run.seed, run.lr, run.eps, run.attention)
    if key not in _REFS:
        _REFS[key] = reference(run)
    return _REFS[key]


def _errors(ref: dict, out: dict) -> dict:
    """Largest absolute difference of the losses, step-0 gradients and final parameters."""
    assert set(out["grads"]) == set(ref["grads"]), "gathered names differ from the GPT's"
    return {"loss": max(abs(a - b) for a, b in zip(ref["losses"], out["losses"])),
            "grad": max((ref["grads"][n] - out["grads"][n]).abs().max().item()
                        for n in ref["grads"]),
            "param": max((ref["params"][n] - out["params"][n]).abs().max().item()
                         for n in ref["params"])}


def _worst(ref: dict, outputs: list) -> float:
    return max(max(_errors(ref, o).values()) for o in outputs)


KV = {(2, "fewer"): 1, (2, "more"): 2, (4, "fewer"): 2, (4, "more"): 4}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kv", ["fewer", "more"], ids=["kv<tp", "kv>=tp"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_parity_with_single_process_and_torch(request, tp, sp, kv, tied):
    """Losses, every gradient (gathered to full shape) on every rank and the parameters after
    3 AdamW steps equal one process; with kv ≥ tp also PyTorch's parallelize_module."""
    run = TPRun(model=_model(KV[tp, kv], tied), tp=tp, sp=sp)
    ref = _reference(run)
    cluster = _cluster(request, tp)
    ours = cluster.run(tp_train, run, nranks=tp).outputs
    for rank, out in enumerate(ours):
        err = _errors(ref, out)
        assert max(err.values()) < TOL, f"rank {rank}: {err}"
    if KV[tp, kv] >= tp:
        theirs = cluster.run(tp_train, TPRun(model=run.model, tp=tp, sp=sp, impl="torch"),
                             nranks=tp).outputs
        assert _worst(ref, theirs) < TOL
        for a, b in zip(ours, theirs):
            assert _worst(a, [b]) < TOL


@pytest.mark.parametrize("tp", [2, 4])
def test_parity_sequence_parallel_regather_and_stage(request, tp):
    """SP keeping only the S/T input shard (all-gathered again in backward), and a
    StageModule (whole model as one stage) whose rotary positions are set by the convert."""
    cluster = _cluster(request, tp)
    for kw in ({"regather": True}, {"as_stage": True}, {"as_stage": True, "regather": True}):
        run = TPRun(model=_model(2, tied=False), tp=tp, sp=True, **kw)
        assert _worst(_reference(run), cluster.run(tp_train, run, nranks=tp).outputs) < TOL


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_core_hook_and_tied_stages(request, tp, sp):
    """attn.core (context parallelism's hook) receives this rank's heads, after rotary and
    before the grouped-query repeat; a tied GPT's first and last stages shard the same rows;
    with SP the boundary activation is (B, S/T, H) and stages get full rotary positions."""
    run = TPRun(model=_model(2), tp=tp, sp=sp)
    r = _cluster(request, tp).run(tp_hooks, run, nranks=tp)
    b, s, d = run.batch, run.model.seq_len, run.model.head_dim
    kv_local = max(2 // tp, 1)
    for out in r.outputs:
        assert out["same"]
        assert out["shapes"] == [((b, 4 // tp, s, d), (b, kv_local, s, d),
                                  (b, kv_local, s, d))] * run.model.n_layers
        assert torch.equal(out["emb"], out["head"]) and out["starts"][0] == out["starts"][1]
        assert out["tied"] == (False, False)  # one table per stage here
        assert out["positions"] == (sp, sp)
        assert out["boundary"] == (b, s // tp if sp else s, run.model.d_model)


@pytest.mark.parametrize("sp", [False, True])
def test_degree_one(cluster2, sp):
    """tp=1 through a one-rank group and without any process group (group=None)."""
    run = TPRun(model=_model(2), tp=1, sp=sp)
    ref = _reference(run)
    assert _worst(ref, cluster2.run(tp_train, run, nranks=1).outputs) < TOL
    from labkit.models import build_model

    model = build_model(run.model, seed=0)
    info = apply_tensor_parallel(model, None, sequence_parallel=sp)
    assert (info.tp, info.padded_vocab, info.padding_bytes) == (1, V, 0)
    x, y = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    ref_model = build_model(run.model, seed=0)
    assert model(x, y).item() == pytest.approx(ref_model(x, y).item(), abs=1e-6)


@pytest.mark.parametrize("mutant,tp,sp,kv", [
    ("no_sp_norm_grad_sum", 2, True, 2), ("no_kv_grad_sum", 4, False, 2),
    ("wrong_vocab_offset", 2, False, 2), ("no_padding_mask", 2, False, 2),
    ("g_backward_all_reduce", 2, False, 2), ("wrong_kv_head", 4, False, 2),
    ("sp_gather_order", 2, True, 2)])
def test_planted_bugs_break_parity(request, mutant, tp, sp, kv):
    """Each planted bug makes some rank's losses, gradients or parameters differ by > TOL."""
    run = TPRun(model=_model(kv), tp=tp, sp=sp, mutant=mutant)
    outs = _cluster(request, tp).run(tp_train, run, nranks=tp).outputs
    assert _worst(_reference(run), outs) > 100 * TOL


CE_CASES = {
    "plain": CECase(), "smoothing": CECase(label_smoothing=0.1),
    "ignore_index": CECase(ignore=True, label_smoothing=0.2), "sum": CECase(reduction="sum"),
    "none": CECase(reduction="none", ignore=True), "large_logits": CECase(scale=1e4),
    "all_padding_rank": CECase(vocab=5, label_smoothing=0.1),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CE_CASES))
def test_vocab_parallel_cross_entropy(request, name, tp):
    """Loss and logit gradient equal F.cross_entropy's (ignore_index, label_smoothing,
    mean/sum/none, logits ~1e4, a rank holding only padding); padding columns, filled with
    1e4, get no gradient; nothing but (N,)-sized tensors crosses ranks."""
    case = CE_CASES[name]
    logits, targets, weights = ce_inputs(case)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, targets, label_smoothing=case.label_smoothing,
                          reduction=case.reduction)
    (ref * weights if case.reduction == "none" else ref).sum().backward()
    r = _cluster(request, tp).run(ce_check, case, nranks=tp)
    for out in r.outputs:
        assert torch.allclose(out["loss"], ref.detach(), atol=TOL, rtol=1e-6)
        g, lo = out["grad"], out["start"]
        real = max(0, min(g.shape[1], case.vocab - lo))
        assert torch.allclose(g[:, :real], full.grad[:, lo:lo + real], atol=TOL)
        assert torch.count_nonzero(g[:, real:]) == 0
    for e in r.trace.filter(op="all_reduce"):
        assert e.args["numel"] in (case.n, 2 * case.n, 3 * case.n)


@pytest.mark.parametrize("mutant", ["no_padding_mask", "ce_local_max"])
def test_cross_entropy_mutants(cluster2, mutant):
    """Padding counted as vocabulary (even as zero logits), or each rank shifting by its own
    max instead of the global one, changes the loss."""
    case = CECase(mutant=mutant, garbage=0.0, scale=3.0)
    r = cluster2.run(ce_check, case, nranks=2)
    logits, targets, _ = ce_inputs(case)
    for out in r.outputs:
        assert abs(out["loss"].item() - F.cross_entropy(logits, targets).item()) > 1e-3


# ------------------------------------------------------------------ measured vs formula
MEASURE = [(tp, sp, rg) for tp in (1, 2, 4) for sp, rg in ((False, False), (True, False),
                                                             (True, True))]
_MEAS: dict = {}


def _measure(request, tp, sp, regather, attention="sdpa", kv=4):
    key = (tp, sp, regather, attention, kv)
    if key not in _MEAS:
        run = TPRun(model=_model(kv), tp=tp, sp=sp, regather=regather, attention=attention)
        _MEAS[key] = (run, _cluster(request, tp).run(tp_measure, run, nranks=tp))
    return _MEAS[key]


@pytest.mark.parametrize("tp,sp,regather", [m for m in MEASURE if m[0] > 1])
def test_bytes_per_block_equal_formula(request, tp, sp, regather):
    """C24–C26: per block and pass, the trace's tp bytes equal two all-reduces of B·S·H (or
    the all-gather + reduce-scatter pairs: the same bytes) exactly; forward communicates only
    at the region boundaries, never between the column and the row matmul."""
    run, r = _measure(request, tp, sp, regather)
    m = run.model
    want = block_bytes_formula(run.batch, m.seq_len, m.d_model, tp, sequence_parallel=sp,
                               regather=regather)
    plain = block_bytes_formula(run.batch, m.seq_len, m.d_model, tp)
    assert want["forward"] == plain["forward"]      # C26: SP moves what TP moves
    assert plain["step"] == 8 * (tp - 1) / tp * run.batch * m.seq_len * m.d_model * 4  # C25
    wg = block_weight_grad_bytes(m.d_model, m.kv_heads * m.head_dim, tp, m.kv_heads,
                                 sequence_parallel=sp)
    fwd_sites = ([("forward", "attn_out", "all_reduce"), ("forward", "mlp_out", "all_reduce")]
                 if not sp else
                 [("forward", "attn_in", "all_gather"), ("forward", "attn_out", "reduce_scatter"),
                  ("forward", "mlp_in", "all_gather"), ("forward", "mlp_out", "reduce_scatter")])
    for rank in range(tp):
        by_layer = tp_bytes_by_layer(r.trace.events, rank, step=0)
        for layer in range(m.n_layers):
            got = by_layer[layer]
            assert got["forward"] == want["forward"] and got["backward"] == want["backward"]
            assert got["weight_grads"] == wg
            assert [x for x in got["sequence"] if x[0] == "forward"] == fwd_sites  # C24


def test_bytes_with_replicated_kv(request):
    """kv < tp: the two K/V weight-gradient all-reduces per block are the only extra bytes,
    on every rank and in every block."""
    run, r = _measure(request, 4, False, False, kv=2)
    m = run.model
    for rank in range(4):
        by_layer = tp_bytes_by_layer(r.trace.events, rank, step=0)
        for layer in range(m.n_layers):
            got = by_layer[layer]
            assert got["weight_grads"] == block_weight_grad_bytes(m.d_model, 2 * m.head_dim,
                                                                  4, 2), (rank, layer)
            assert got["forward"] == block_bytes_formula(run.batch, m.seq_len, m.d_model,
                                                         4)["forward"], (rank, layer)


@pytest.mark.parametrize("tp,kv", [(1, 4), (2, 4), (4, 4), (4, 2)])
def test_model_state_bytes_divided_by_tp(request, tp, kv):
    """Parameters, gradients and AdamW moments per rank (counted from the tensors each rank
    holds) equal the formula exactly: the split weights divided by tp, K/V whole when
    kv_heads < tp, norms whole, the vocabulary padded (padding bytes as reported)."""
    run, r = _measure(request, tp, False, False, kv=kv)
    want = tp_state_bytes_formula(run.model, tp)
    for out in r.outputs:
        got = out["state"]
        assert (got["params"], got["grads"], got["optimizer"]) == \
            (want["params"], want["grads"], want["optimizer"])
        assert out["padding_bytes_total"] == (-(-V // tp) * tp - V) * run.model.d_model * 4
    h, pad = run.model.d_model, -(-V // tp) * tp - V
    assert r.outputs[-1]["padding_bytes"] == (pad * h * 4 if tp > 1 else 0)
    m = run.model
    norms = (2 * m.n_layers + 1) * h * 4
    kv_bytes = m.n_layers * 2 * m.kv_heads * m.head_dim * h * 4  # wk, wv of every block
    split = want["full_params"] - norms - kv_bytes
    kv_rank = kv_bytes // tp if m.kv_heads >= tp else kv_bytes  # replicated when K < T
    assert want["params"] == norms + kv_rank + (split + pad * h * 4) // tp


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("tp,sp,regather", MEASURE)
def test_activation_memory_equals_adjusted_c18(request, tp, sp, regather, attention):
    """C18 adjusted to this model: every block's saved-for-backward bytes equal the formula
    exactly, with and without recomputing the attention core; with SP (regather) and the core
    recomputed, tp ranks hold exactly 1/tp of one process's bytes (the adjusted 34·SBH/T)."""
    run, r = _measure(request, tp, sp, regather, attention)
    for recompute, key in ((False, "act"), (True, "act_recompute")):
        want = block_activation_formula(run.model, run.batch, run.model.seq_len, tp,
                                        sequence_parallel=sp, regather=regather,
                                        recompute=recompute, impl=attention)
        for out in r.outputs:
            for layer in range(run.model.n_layers):
                assert out[key][layer] == want, (key, layer)
    if tp == 1:  # the same count as the checkpointing module's per-layer formula
        from labkit.parallel.checkpoint.jobs import adjusted_layer_bytes

        assert r.outputs[0]["act"][0] == adjusted_layer_bytes(run.model, run.batch,
                                                              attention=attention)
    if sp and regather:
        _, single = _measure(request, 1, False, False, attention)
        for out in r.outputs:
            assert out["act_recompute"][0] * tp == single.outputs[0]["act_recompute"][0]
    lecture = lecture_activation_bytes(16, 2, 32, 4, tp, sequence_parallel=sp, recompute=True)
    assert lecture == pytest.approx(34 * 16 * 2 * 32 / tp if sp else
                                    (10 + 24 / tp) * 16 * 2 * 32)


def test_tp_vs_pp_bytes(request, cluster4):
    """C33: for the same model and batch, 4-way TP sends 4·L·(T−1)/T times what an inner
    pipeline stage sends (one B·S·H tensor per microbatch each way), measured from both
    jobs' traces."""
    from labkit import jobs
    from labkit.config import RunConfig

    m = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, seq_len=16,
                    tie_embeddings=False)  # the pipeline job trains on bytes
    b, micro = 8, 4
    want = tp_vs_pp_bytes(b, m.seq_len, m.d_model, m.n_layers, 4, microbatches=micro)
    pp = cluster4.run(jobs.train, RunConfig(model=m, global_batch=b, microbatches=micro,
                                            steps=1, measure_memory=False,
                                            count_flops=False).replace(pp=4))
    sends = [pp.trace.comm_bytes(rank, op="send", step=0) for rank in range(4)]
    assert sends == [want["pp_edge"], want["pp_inner"], want["pp_inner"], want["pp_edge"]]
    run = TPRun(model=m, tp=4, batch=b)
    tp = cluster4.run(tp_measure, run, nranks=4)
    for rank in range(4):
        blocks = tp_bytes_by_layer(tp.trace.events, rank, step=0)
        measured = sum(blocks[i]["forward"] + blocks[i]["backward"] for i in range(m.n_layers))
        assert measured == want["tp"], rank
        assert measured / sends[1] == want["ratio"] == 4 * m.n_layers * 3 / 4


# ------------------------------------------------------------------ bad input, planner
@pytest.mark.parametrize("kw,tp,sp,msg", [
    (dict(n_heads=4), 8, False, "tp=8 is larger than n_heads=4"),
    (dict(n_heads=6, d_model=48), 4, False, "n_heads=6 does not divide by tp=4"),
    (dict(n_heads=8, n_kv_heads=4, d_model=64), 8, False, None),
    (dict(n_heads=8, n_kv_heads=2, d_model=64), 4, False, None),
    (dict(n_heads=12, n_kv_heads=6, d_model=96), 4, False, "kv_heads=6 does not divide by tp=4"),
    (dict(n_heads=12, n_kv_heads=4, d_model=96), 6, False, "tp=6 does not divide by kv_heads=4"),
    (dict(d_ff=90), 4, False, "ffn_dim=90 does not divide by tp=4"),
    (dict(seq_len=18), 4, True, "seq_len=18 does not divide by tp=4"),
    (dict(seq_len=18), 4, False, None),
    (dict(), 0, False, "tp must be a positive integer"),
])
def test_check_tensor_parallel(kw, tp, sp, msg):
    cfg = ModelConfig(**{"n_layers": 1, "d_model": 32, "n_heads": 4, **kw})
    if msg is None:
        check_tensor_parallel(cfg, tp, sp)
    else:
        with pytest.raises(ValueError, match=msg):
            check_tensor_parallel(cfg, tp, sp)


def test_apply_refuses_bad_options():
    from labkit.models import build_model

    model = build_model(_model(2), seed=0)
    with pytest.raises(ValueError, match="regather"):
        apply_tensor_parallel(model, None, regather=True)
    apply_tensor_parallel(model, None)
    with pytest.raises(ValueError, match="already"):
        apply_tensor_parallel(model, None)


def test_tp_scaling_drops_at_the_node_boundary():
    """C27 through the planner: within a node (≤ 8) the per-GPU throughput falls by little,
    past it (16, 32) steeply, with H100 NVLink vs per-GPU InfiniBand bandwidths."""
    from labkit.plan.tp_scaling import tp_efficiency, tp_scaling_curve

    curve = {r["tp"]: r["drop"] for r in tp_scaling_curve(hidden=8192, seq=4096)}
    assert curve[1] == 0 and all(curve[a] < curve[b] for a, b in zip(curve, list(curve)[1:]))
    assert curve[8] < 0.15 and curve[16] > 0.42
    assert curve[16] - curve[8] > 5 * curve[8]
    same = tp_efficiency(16, hidden=8192, seq=4096, gpus_per_node=16)
    assert same["drop"] < 0.2  # the cliff is the link, not the degree
    with pytest.raises(ValueError, match="node_bw"):
        tp_efficiency(2, hidden=1, seq=1, node_bw=0)
    assert math.isclose(tp_efficiency(8, hidden=8192, seq=4096, overlap=1.0)["drop"], 0.0)
