"""Context parallelism: the zigzag layout, blockwise attention with an explicit log-sum-exp,
parity of all-gather / Ulysses / ring attention with one process (output, dQ, dK, dV on every
rank; the whole GPT's loss and gradients), the measured work, bytes, K/V working set and
activation memory beside their formulas, and refusal of impossible layouts before launch."""
from __future__ import annotations

import itertools

import pytest
import torch

from labkit.config import ModelConfig
from labkit.mesh import Mesh
from labkit.models.gpt import attention_core
from labkit.parallel.context import (check_context_parallel, chunk_ids, imbalance,
                                     make_attention_core, positions, shard_sequence,
                                     tokens_per_rank, unshard_sequence)
from labkit.parallel.context import jobs
from labkit.parallel.context.blocks import (AttentionSpec, LocalAttention, WorkCounter,
                                            block_forward, group_heads, merge)
from labkit.parallel.context.layout import causal_pairs_closed_form, chunk_len
from labkit.parallel.context.measure import bytes_formula, ring_overlap, trace_bytes
from labkit.parallel.context.report import attention_report, model_report
from labkit.trace import Event

TOL = 1e-5  # fp32 parity (DESIGN §4)
METHODS = ("allgather", "ulysses", "ring")


# --------------------------------------------------------------------------- layout
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("zigzag", [True, False])
def test_shard_unshard_and_positions(cp, zigzag):
    x = torch.arange(3 * 16).reshape(3, 16)
    shards = [shard_sequence(x, r, cp, zigzag) for r in range(cp)]
    assert all(s.shape == (3, 16 // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards, zigzag), x)
    for r in range(cp):
        pos = positions(r, cp, 16, zigzag)
        assert pos.dtype == torch.int64 and torch.equal(shards[r][0], pos)
    assert sorted(torch.cat([positions(r, cp, 16, zigzag) for r in range(cp)]).tolist()) \
        == list(range(16))


def test_zigzag_holds_an_early_and_a_late_chunk():
    assert [chunk_ids(r, 4, True) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, False) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert positions(1, 2, 8, True).tolist() == [2, 3, 4, 5]
    assert positions(0, 2, 8, True).tolist() == [0, 1, 6, 7]


def test_labels_follow_the_tokens():
    """Shift, then shard with the same layout: every label stays the next token."""
    seq = torch.arange(17).unsqueeze(0) * 3
    x, y = seq[:, :-1], seq[:, 1:]
    for r in range(4):
        xs, ys = shard_sequence(x, r, 4, True), shard_sequence(y, r, 4, True)
        pos = positions(r, 4, 16, True)
        assert torch.equal(xs[0], seq[0, pos]) and torch.equal(ys[0], seq[0, pos + 1])


def test_closed_form_work_contiguous_vs_zigzag():
    s, cp = 64, 4
    c = s // cp
    contiguous = [causal_pairs_closed_form(r, cp, s, False) for r in range(cp)]
    assert contiguous == [c * c * r + c * (c + 1) // 2 for r in range(cp)]
    cz = s // (2 * cp)
    zigzag = [causal_pairs_closed_form(r, cp, s, True) for r in range(cp)]
    assert zigzag == [cz * cz * (2 * cp - 1) + cz * (cz + 1)] * cp
    assert sum(contiguous) == sum(zigzag) == s * (s + 1) // 2
    assert imbalance(zigzag) == 1.0 and imbalance(contiguous) == pytest.approx(14464 / 8320)
    assert causal_pairs_closed_form(1, cp, s, True, causal=False) == s * s // cp


def test_c29_llama3_long_context_tokens_per_gpu():
    """claim C29: 131,072-token sequences on 16-way CP give 8,192 tokens per GPU."""
    assert tokens_per_rank(131_072, 16) == 8_192
    assert chunk_len(131_072, 16, zigzag=True) == 4_096  # two zigzag chunks of 4,096
    with pytest.raises(ValueError, match="131073"):
        tokens_per_rank(131_073, 16)


# --------------------------------------------------------------------------- block math
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_chunks", [1, 2, 4])
def test_local_attention_equals_attention_core(causal, n_chunks):
    """Chunks stored out of order, grouped-query heads: forward and backward written out
    equal autograd through the explicit softmax."""
    g = torch.Generator().manual_seed(1)
    b, a, kh, s, d = 2, 4, 2, 16, 8
    q, k, v, do = (torch.randn(*shape, generator=g) for shape in
                   ((b, a, s, d), (b, kh, s, d), (b, kh, s, d), (b, a, s, d)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = attention_core(q, k, v, causal, "math")
    grads = torch.autograd.grad(ref, (q, k, v), do)
    c = s // n_chunks
    qc, kc = tuple(reversed(range(n_chunks))), tuple(range(1, n_chunks)) + (0,)

    def perm(x, ids):
        return torch.cat([x[:, :, i * c:(i + 1) * c] for i in ids], 2)

    counter = WorkCounter()
    qq, kk, vv = (perm(t.detach(), ids).requires_grad_() for t, ids in
                  ((q, qc), (k, kc), (v, kc)))
    out = LocalAttention.apply(qq, kk, vv, AttentionSpec(qc, kc, c, causal, counter))
    mine = torch.autograd.grad(out, (qq, kk, vv), perm(do, qc))
    assert (out - perm(ref, qc)).abs().max() < TOL
    for m, r, ids in zip(mine, grads, (qc, kc, kc)):
        assert (m - perm(r, ids)).abs().max() < TOL
    pairs = s * (s + 1) // 2 if causal else s * s
    assert counter.pairs == {"forward": b * a * pairs, "backward": b * a * pairs}


def test_log_sum_exp_merge_is_exact_in_any_order():
    g = torch.Generator().manual_seed(2)
    q = group_heads(torch.randn(1, 2, 4, 8, generator=g), 1)
    k, v = torch.randn(1, 1, 12, 8, generator=g), torch.randn(1, 1, 12, 8, generator=g)
    whole, lse_whole = block_forward(q, k, v, "full", 8 ** -0.5)
    parts = [block_forward(q, k[:, :, i:i + 4], v[:, :, i:i + 4], "full", 8 ** -0.5)
             for i in (0, 4, 8)]
    for order in itertools.permutations(range(3)):
        out = torch.zeros_like(whole)
        lse = torch.full(lse_whole.shape, float("-inf"))
        for i in order:
            out, lse = merge(out, lse, *parts[i])
        assert (out - whole).abs().max() < 1e-6 and (lse - lse_whole).abs().max() < 1e-6


# --------------------------------------------------------------------------- bad input
def _cfg(**kw):
    base = dict(n_layers=1, d_model=64, n_heads=8, n_kv_heads=4, seq_len=64)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("args,match", [
    (dict(cp=4, method="ring", zigzag=False, seq_len=30), r"30 does not divide by cp = 4"),
    (dict(cp=4, method="ring", zigzag=True, seq_len=36), r"36 does not divide by 2·cp = 8"),
    (dict(cp=3, method="ulysses", zigzag=False, seq_len=48), r"query heads .*8.* cp=3"),
    (dict(cp=8, method="ulysses", zigzag=False, seq_len=64), r"key/value heads .*4.* cp=8"),
    (dict(cp=4, method="ulysses", zigzag=True, seq_len=64, tp=2),
     r"key/value heads .*4 / tp=2 = 2.* cp=4"),
    (dict(cp=2, method="ring", zigzag=True, seq_len=64, tp=3), r"divide by tp=3"),
    (dict(cp=2, method="zigzag", zigzag=True, seq_len=64), r"unknown .*'zigzag'"),
    (dict(cp=0, method="ring", zigzag=True, seq_len=64), r"cp must be .* got 0"),
    (dict(cp=2, method="ring", zigzag=True, seq_len=128), r"128 exceeds .*seq_len=64"),
])
def test_check_context_parallel_names_the_numbers(args, match):
    """claim C28: Ulysses needs (query and K/V) heads divisible by cp."""
    with pytest.raises(ValueError, match=match):
        check_context_parallel(_cfg(), **args)


def test_valid_layouts_pass_the_check():
    check_context_parallel(_cfg(), 4, "ulysses", True, 64)
    check_context_parallel(_cfg(), 2, "ulysses", True, 64, tp=2)
    check_context_parallel(_cfg(n_kv_heads=1), 8, "ring", True, 64)  # ring: any head count
    with pytest.raises(ValueError, match="unknown context-parallel method 'rings'"):
        make_attention_core("rings", None, seq_len=64)


# --------------------------------------------------------------------------- pure measures
def test_ring_overlap_from_spans():
    ev = [Event(0, "cp.ring.forward", "compute", 1.0, 2.0),
          Event(0, "send", "p2p", 0.5, 2.5, axis="cp", args={"phase": "forward"}),
          Event(0, "recv", "p2p", 1.5, 2.0, axis="cp", args={"phase": "forward"}),
          Event(1, "send", "p2p", 0.0, 9.0, axis="cp", args={"phase": "forward"})]
    assert ring_overlap(ev, 0) == pytest.approx((1.0 + 0.5) / (2.0 + 0.5))
    assert ring_overlap(ev, 0, "backward") == 0.0 and ring_overlap(ev, 1) == 0.0


def test_bytes_formula_by_hand():
    shape = dict(batch=1, heads=4, kv_heads=2, seq_len=8, head_dim=2)  # kv = 2·1·2·4·2·4 B
    kv, q = 128, 128
    assert bytes_formula("allgather", 2, **shape) == {"forward": kv, "backward": kv,
                                                      "total": 2 * kv}
    assert bytes_formula("ulysses", 2, **shape)["forward"] == (2 * q + kv) / 2
    assert bytes_formula("ring", 2, **shape) == {"forward": kv, "backward": 3 * kv,
                                                 "total": 4 * kv}
    assert bytes_formula("ring", 1, **shape)["total"] == 0


# --------------------------------------------------------------------------- distributed
_RUNS: dict = {}


def _run(request, case, cluster="cluster4"):
    key = (case, cluster)
    if key not in _RUNS:
        _RUNS[key] = jobs.run(request.getfixturevalue(cluster), case)
    return _RUNS[key]


def _case(method, cp, causal, zigzag):
    # grouped-query (2 query heads per K/V head), 4 K/V heads so that Ulysses splits at cp=4
    return jobs.AttentionCase(method=method, cp=cp, causal=causal, zigzag=zigzag,
                              n_heads=8, n_kv_heads=4, seq_len=16, head_dim=8, batch=2)


def _assert_parity(result, case, tp=1):
    ref = jobs.reference_attention(case)
    cp = case.mesh.cp if case.mesh else case.cp
    seen = set()
    for o in result.outputs:  # every rank, never rank 0 only
        for key in ("out", "dq", "dk", "dv"):
            heads = (case.n_heads if key in ("out", "dq") else case.n_kv_heads) // tp
            full = ref[key][:, o["tp_rank"] * heads:(o["tp_rank"] + 1) * heads]
            want = shard_sequence(full, o["cp_rank"], cp, case.zigzag, dim=2)
            err = (o[key] - want).abs().max().item()
            assert err < TOL, (o["rank"], key, err)
        seen.add((o["cp_rank"], o["tp_rank"]))
    assert len(seen) == len(result.outputs)


@pytest.mark.distributed
@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_attention_parity(request, method, cp, causal, zigzag):
    """claim C28: each rank holds (B, S/cp) of q, k, v; its output and gradients are its rows
    of one process's."""
    case = _case(method, cp, causal, zigzag)
    _assert_parity(_run(request, case, f"cluster{cp}"), case)


@pytest.mark.distributed
@pytest.mark.parametrize("method", METHODS)
def test_degree_one_is_single_process_attention(request, method):
    case = jobs.AttentionCase(method=method, cp=1, n_heads=4, n_kv_heads=2)
    r = _run(request, case, "cluster2")
    _assert_parity(r, case)
    assert sum(e.bytes_sent for e in r.trace.events) == 0


@pytest.mark.distributed
@pytest.mark.parametrize("method", METHODS)
def test_parity_beside_tensor_parallel_heads(request, method):
    """cp=2 × tp=2 mesh: the cp groups are {0, 2} and {1, 3} (global ranks ≠ group ranks),
    each rank holds its tensor-parallel block of heads."""
    case = jobs.AttentionCase(method=method, mesh=Mesh(cp=2, tp=2), n_heads=8, n_kv_heads=4)
    r = _run(request, case)
    _assert_parity(r, case, tp=2)
    assert {(o["rank"], o["cp_rank"], o["tp_rank"]) for o in r.outputs} == \
        {(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)}


@pytest.mark.distributed
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cp", [2, 4])
def test_measured_work_bytes_and_kv_equal_the_formulas(request, method, cp):
    reps = {zz: attention_report(_run(request, _case(method, cp, True, zz), f"cluster{cp}"))
            for zz in (True, False)}
    for rep in reps.values():
        assert rep["work"] == rep["work_formula"]  # the ranks' own counters
        assert rep["bytes"] == rep["bytes_formula"]  # exact, from the trace
        assert rep["kv_bytes"] == rep["kv_formula"]
        for o in rep["overlap"]:
            assert set(o) == {"forward", "backward"} and all(0 <= f <= 1 for f in o.values())
    assert reps[True]["imbalance"] == 1.0
    if method == "ulysses":  # heads split: balanced whatever the sequence split
        assert reps[False]["imbalance"] == 1.0
    else:
        # the last rank's queries see the whole prefix: (2cp−1)/cp for long chunks
        assert reps[False]["imbalance"] == pytest.approx((2 * cp - 1) / cp, abs=0.05)
        assert reps[False]["work"] == sorted(reps[False]["work"])  # the last rank works most
    assert bool(reps[True]["overlap"]) == (method == "ring")


_MODEL_REF: dict = {}


def _model_reference(case):
    key = (case.model, case.batch, case.seed)
    if key not in _MODEL_REF:
        _MODEL_REF[key] = (jobs.reference_model(case),
                           jobs.reference_model(case, blockwise=True)["saved_bytes"])
    return _MODEL_REF[key]


@pytest.mark.distributed
@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_whole_model_loss_gradients_and_memory(request, method, cp, zigzag):
    """Every block's attn.core set, tokens/labels/positions sharded: the summed loss and the
    cp-summed gradients (on every rank) equal one process; activations per rank are
    1/cp of one rank's (plus this rank's rotary rows, plus the gathered K/V for all-gather, the
    attention output's second copy for Ulysses)."""
    case = jobs.ModelCase(method=method, zigzag=zigzag, cp=cp)
    ref, single = _model_reference(case)
    r = _run(request, case, f"cluster{cp}")
    assert abs(sum(o["loss"] for o in r.outputs) - ref["loss"]) < TOL
    for o in r.outputs:
        assert o["grads"].keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            assert (o["grads"][name] - g).abs().max().item() < TOL, (o["rank"], name)
    m = case.model  # bytes per training step on the cp axis: every layer's attention
    per_call = bytes_formula(method, cp, batch=case.batch, heads=m.n_heads,
                             kv_heads=m.kv_heads, seq_len=m.seq_len, head_dim=m.head_dim)
    for o in r.outputs:
        assert trace_bytes(r.trace, o["rank"]) == m.n_layers * per_call["total"]
    mem = model_report(r, single)
    assert mem["saved"] == [mem["formula"]] * cp
    rope = case.model.seq_len // cp * case.model.head_dim * 4
    if method == "ring":
        assert mem["saved"][0] == single / cp + rope
    if method == "ulysses":  # the attention output again, as the output projection's input
        out = m.n_layers * case.batch * (m.seq_len // cp) * m.n_heads * m.head_dim * 4
        assert mem["saved"][0] == single / cp + rope + out


@pytest.mark.distributed
def test_impossible_layouts_are_refused_before_launch(cluster2):
    with pytest.raises(ValueError, match=r"key/value heads .*1.* cp=2"):
        jobs.run(cluster2, jobs.AttentionCase(method="ulysses", cp=2, n_kv_heads=1))
    with pytest.raises(ValueError, match=r"12 does not divide by 2·cp = 8"):
        jobs.run(cluster2, jobs.AttentionCase(method="ring", cp=4, seq_len=12))
    with pytest.raises(ValueError, match=r"does not divide by 2·cp = 4"):
        jobs.run(cluster2, jobs.ModelCase(method="ring", model=ModelConfig(seq_len=18)))
    ok = jobs.run(cluster2, jobs.AttentionCase(method="ring", cp=2))
    assert len(ok.outputs) == 2
