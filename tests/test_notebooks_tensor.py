"""notebooks/06_tensor_parallel.ipynb as stored: what its checked cells expect.

nbval (``make test``) re-runs the notebook and compares each ``# NBVAL_CHECK_OUTPUT`` cell's
output with the stored one. That only proves the output did not change: a stored ``False``
would be compared against a fresh ``False`` and pass. These pure tests read the stored
notebook and check that the expected outputs are the right ones: every measured number equal
to its formula (recomputed here from labkit's pure functions), parity, claims C18, C24–C27
and C33, and that nothing else is stored.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from notebook_outputs import (assert_only_checked_cells_store_output, checked as _checked,
                              checked_output as _checked_output, text as _text)
import pytest

from labkit.config import preset
from labkit.parallel.tensor.activations import block_activation_formula, lecture_activation_bytes
from labkit.parallel.tensor.measure import (block_bytes_formula, block_weight_grad_bytes,
                                            tp_state_bytes_formula, tp_vs_pp_bytes)
from labkit.plan.tp_scaling import tp_scaling_curve

NB = Path(__file__).resolve().parents[1] / "notebooks" / "06_tensor_parallel.ipynb"
TINY = preset("tiny")     # the notebook's model: 2 blocks, H 64, 4 heads, S 64
B = 2                     # its global batch
RUNS = {"tp1": (1, False), "tp2": (2, False), "tp4": (4, False), "tp2-sp": (2, True),
        "tp4-sp": (4, True)}


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def test_every_checked_cell_stores_output_and_no_other_cell_does(cells):
    assert_only_checked_cells_store_output(cells, at_least=10)


def test_stored_expectations_are_passes(cells):
    text = "\n".join(_text(c) for c in _checked(cells))
    assert not re.search(r"\bFalse\b|MISMATCH|\bnan\b|≠", text), text


def test_c24_column_then_row_needs_nothing_in_between(cells):  # claim C24
    out = _checked_output(cells, "A_cols, B_rows")
    assert "rank i: A_i (16, 16), B_i (16, 16), Z_i (2, 8, 16)" in out
    assert "== Z (one all-reduce at the end): True" in out
    assert "an all-reduce is needed before GeLU: True" in out
    out = _checked_output(cells, 'runs = {"tp2": tp_run(2)}')
    block = ("attn_out all_reduce, mlp_out all_reduce", "mlp_in all_reduce, attn_in all_reduce")
    outside = ("emb_out all_reduce, loss all_reduce, loss all_reduce", "head_in all_reduce")
    pad = " " * 26
    for rank in (0, 1):   # each group: its forward line, then its backward line
        where = f"rank {rank}, outside the blocks"
        assert f"{where:26s}  forward:  {outside[0]}\n{pad}  backward: {outside[1]}\n" in out
        for layer in range(TINY.n_layers):
            where = f"rank {rank}, block {layer}"
            assert f"{where:26s}  forward:  {block[0]}\n{pad}  backward: {block[1]}\n" in out
    assert len(out.splitlines()) == 2 * 2 * (TINY.n_layers + 1)


def test_parity_on_every_rank(cells):
    out = _checked_output(cells, "runs checked")
    assert "runs checked: 4 | ranks: 12 |" in out
    assert "every rank of every run within 1e-5 of one process: True" in out


def test_c25_c26_bytes_per_block_equal_the_formula(cells):  # claims C25, C26
    out = _checked_output(cells, "def ops(")
    rows = re.findall(r"^(tp\d(?:-sp)?)\s+(\d)\s+(forward|backward)\s+(.+?)\s+(\d+)\s+(\d+)"
                      r"\s+(\d+)$", out, re.M)
    assert len(rows) == 4 * TINY.n_layers * 2
    kv = TINY.kv_heads * TINY.head_dim
    for name, _layer, phase, ops, got, formula, norm_grads in rows:
        t, sp = RUNS[name]
        want = block_bytes_formula(B, TINY.seq_len, TINY.d_model, t, sequence_parallel=sp,
                                   regather=sp)
        plain = block_bytes_formula(B, TINY.seq_len, TINY.d_model, t)
        unit = (t - 1) / t * B * TINY.seq_len * TINY.d_model * 4   # one all-gather
        assert int(got) == int(formula) == want[phase]
        # C26: the SP pair moves the all-reduce's bytes; backward re-gathers the two inputs
        assert want[phase] == plain[phase] + (2 * unit if sp and phase == "backward" else 0)
        assert plain[phase] == 2 * 2 * (t - 1) / t * B * TINY.seq_len * TINY.d_model * 4  # C25
        assert ops == ("2 all_reduce" if not sp else "2 all_gather + 2 reduce_scatter"
                       if phase == "forward" else "4 all_gather + 2 reduce_scatter")
        extra = block_weight_grad_bytes(TINY.d_model, kv, t, TINY.kv_heads,
                                        sequence_parallel=sp)
        assert int(norm_grads) == (extra if phase == "backward" else 0)
        assert (int(norm_grads) > 0) == (sp and phase == "backward")
    assert out.count("every rank, every block, both passes == formula: True") == 4


def test_each_collective_sends_its_ring_share(cells):  # claims C25, C26
    """One call at a time: an all-reduce 2(T−1)/T·B·S·H·4 bytes, an all-gather or a
    reduce-scatter half that, 8 of each kind per rank per step in the 2 blocks, and with SP
    4 more all-gathers (the inputs re-gathered in backward)."""
    out = _checked_output(cells, "ACT_SITES")
    rows = re.findall(r"^(tp\d(?:-sp)?)\s+(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+); every call on "
                      r"every rank: (\w+)$", out, re.M)
    seen = {}
    for name, op, calls, got, formula, rule, ok in rows:
        t, sp = RUNS[name]
        k = 2 if op == "all_reduce" else 1
        want = k * (t - 1) / t * B * TINY.seq_len * TINY.d_model * 4
        assert int(got) == int(formula) == want and ok == "True"
        assert rule == ("2" if k == 2 else "") + "(T−1)/T·B·S·H·4"
        assert int(calls) == (3 if op == "all_gather" else 2) * 2 * TINY.n_layers
        seen.setdefault(name, []).append(op)
    assert seen == {"tp2": ["all_reduce"], "tp4": ["all_reduce"],
                    "tp2-sp": ["all_gather", "reduce_scatter"],
                    "tp4-sp": ["all_gather", "reduce_scatter"]}
    assert len(out.splitlines()) == 1 + len(rows)


def test_whole_step_tp_bytes_equal_the_jobs_prediction(cells):
    out = _checked_output(cells, "comm_predicted_by_axis")
    sent = [ast.literal_eval(s) for s in re.findall(r"sent per step (\{.*\})", out)]
    predicted = [ast.literal_eval(s) for s in re.findall(r"predicted\s+(\{.*\})", out)]
    assert len(sent) == len(predicted) == 4 and sent == predicted
    assert set(sent[0]) == {"all_reduce"} and set(sent[1]) == {"all_gather", "reduce_scatter",
                                                                "all_reduce"}
    unit = (2 - 1) / 2 * B * TINY.seq_len * TINY.d_model * 4   # tp2-sp: one all-gather
    # the two pair inputs of each block and the head's input, re-gathered in backward
    assert sent[1]["all_gather"] - sent[1]["reduce_scatter"] == (2 * TINY.n_layers + 1) * unit
    assert "every rank of every run: measured == predicted: True" in out


def test_timeline_shows_two_collectives_per_block_and_pass(cells):  # claim C25
    out = _checked_output(cells, "def lane(")
    for rank in (0, 1):
        assert f"rank {rank}, step 1: emb L0 L0 L1 L1 loss loss head L1 L1 L0 L0\n" in out
    assert out.count("2 forward, 2 backward") == 2 * TINY.n_layers
    assert not re.search(r"L\d: (?!2 forward, 2 backward)", out)


def test_model_state_per_rank_divided_by_tp(cells):
    out = _checked_output(cells, "tp_state_bytes_formula(mc, T)")
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*[124]\s+\d", line)]
    assert [r[0] for r in rows] == ["1", "2", "4"]
    full = tp_state_bytes_formula(TINY, 1)["params"]
    norms = (2 * TINY.n_layers + 1) * TINY.d_model * 4
    counters = 4 * (9 * TINY.n_layers + 2)   # AdamW's step counter per parameter tensor
    for t, params, grads, optimizer, ok, ratio, split in rows:
        t = int(t)
        want = tp_state_bytes_formula(TINY, t)
        assert int(params) == int(grads) == want["params"] == int(split)
        assert int(params) == (full - norms) // t + norms
        assert int(optimizer) == want["optimizer"] + counters == 2 * int(params) + counters
        assert ok == "True" and float(ratio) == pytest.approx(int(params) / full, abs=1e-4)


def test_c18_activation_memory_per_block(cells):  # claim C18
    out = _checked_output(cells, "block_activation_formula(mc, Bsz, S, T, sequence_parallel=sp, "
                                 "regather=sp)")
    s, h, a = TINY.seq_len, TINY.d_model, TINY.n_heads
    assert f"S·B·H·(34 + 5·A·S/H) = {lecture_activation_bytes(s, B, h, a):,.0f} bytes" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith("tp")}
    assert set(rows) == set(RUNS)
    one = block_activation_formula(TINY, B, s, 1)
    for name, (got, formula, ok, frac, lecture) in rows.items():
        t, sp = RUNS[name]
        want = block_activation_formula(TINY, B, s, t, sequence_parallel=sp, regather=sp)
        assert _int(got) == _int(formula) == want and ok == "True"
        assert float(frac) == pytest.approx(want / one, abs=1e-4)
        lec = (lecture_activation_bytes(s, B, h, a, t, sequence_parallel=sp, recompute=True)
               / lecture_activation_bytes(s, B, h, a, recompute=True))
        assert float(lecture) == pytest.approx(lec, abs=1e-4)
        if t > 1 and not sp:  # TP divides most, but not the norms and the pair inputs
            assert 1 / t < float(frac) < 1
        if sp:  # SP with the pair inputs' shards kept: every term, exactly 1/T
            assert float(frac) == pytest.approx(1 / t, abs=1e-4) and want * t == one
    assert float(rows["tp2-sp"][3]) < float(rows["tp2"][3])
    assert float(rows["tp4-sp"][3]) < float(rows["tp4"][3])
    out = _checked_output(cells, "regather=True")
    for t in (1, 2, 4):   # the adjusted 34·S·B·H/T: exactly 1/T
        b = block_activation_formula(TINY, B, s, t, sequence_parallel=True, regather=True,
                                     recompute=True)
        assert b * t == block_activation_formula(TINY, B, s, 1, sequence_parallel=True,
                                                 regather=True, recompute=True)
        assert f"T={t}: {b:,} bytes per block, {1 / t:.4f} of" \
            in out


def test_c18_by_part_in_bf16_is_the_count_plus_named_terms(cells):  # claim C18
    """The job's own blocks (tp 2, SP, bf16 under autocast), per part: the stored bytes are
    labkit.measure.layer_activations' prediction, Korthikanti et al.'s count plus the named
    terms (1/rms per norm; the fp32 residual stream under autocast), and nothing else."""
    from labkit.config import RunConfig
    from labkit.measure.layer_activations import predicted_layer_activations

    out = _checked_output(cells, "job_layer_activations")
    cfg = RunConfig(steps=3, global_batch=2, count_flops=False, parallel=dict(tp=2),
                    sequence_parallel=True, precision="bf16")
    want = predicted_layer_activations(cfg)
    rows = re.findall(r"^(\w+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)$", out, re.M)
    assert [r[0] for r in rows] == ["attn_norm", "attn", "mlp_norm", "mlp"]
    for part, got, c18, total in rows:
        assert _int(got) == _int(total) == want["total"][part]
        assert _int(c18) == want["megatron"][part]
    terms = dict(re.findall(r"^named term: (.+): ([\d,]+) B$", out, re.M))
    assert {k: _int(v) for k, v in terms.items()} == {
        k: sum(v.values()) for k, v in want["adjustments"].items()}
    assert set(terms) == {"1/rms per norm (fp32)",
                          "fp32 residual stream (autocast): norm inputs"}
    assert "every part of every block on every rank == count + named terms: True" in out


def test_c33_tp_sends_far_more_than_pp(cells):  # claim C33
    out = _checked_output(cells, "tp_vs_pp_bytes(")
    want = tp_vs_pp_bytes(4, 64, 64, 4, 4, microbatches=4)
    pp = ast.literal_eval(re.search(r"PP, sent per rank per step:\s+(\[.*?\])", out).group(1))
    tp = ast.literal_eval(re.search(r"TP, blocks, sent per rank per step: (\[.*?\])", out).group(1))
    assert pp == [want["pp_edge"], want["pp_inner"], want["pp_inner"], want["pp_edge"]]
    assert tp == [want["tp"]] * 4 and want["ratio"] == 12
    assert "TP / middle PP stage: 12  (4·L·(T−1)/T = 12)" in out
    whole = ast.literal_eval(re.search(r"embedding, head and loss: (\[.*?\])", out).group(1))
    assert all(w > t for w, t in zip(whole, tp))


def test_c27_curve_drops_at_the_server_boundary(cells):  # claim C27
    out = _checked_output(cells, "LECTURE_DROP[t]")
    rows = {int(r[0]): r[1:] for r in (line.split() for line in out.splitlines())
            if r and r[0].isdigit()}
    assert sorted(rows) == [1, 2, 4, 8, 16, 32]
    drop = {t: float(r[1].rstrip("%")) / 100 for t, r in rows.items()}
    drop16 = {t: float(r[2].rstrip("%")) / 100 for t, r in rows.items()}
    assert all(drop[a] < drop[b] for a, b in zip(sorted(drop), sorted(drop)[1:]))
    assert drop[8] < 0.15 and drop[16] > 0.42                      # gentle, then a cliff
    assert drop16[16] < 0.2 and drop16[32] == drop[32]             # the link, not the degree
    assert {t: r[3] for t, r in rows.items() if t > 1} == {2: "10%", 4: "10%", 8: "12%",
                                                           16: "42%", 32: "65%"}
    assert [rows[t][0] for t in sorted(rows)] == ["900"] * 4 + ["50"] * 2
    for per_server, col in ((8, 1), (16, 2)):   # the planner's own numbers, as stored
        curve = tp_scaling_curve(hidden=8192, seq=4096, gpus_per_node=per_server)
        assert [rows[r["tp"]][col] for r in curve] == [f"{r['drop']:.1%}" for r in curve]
    source = "\n".join(c.source for c in cells)
    assert "tp_scaling_curve(" in source and "go.Figure()" in source   # drawn as a curve


def test_the_cluster_outlives_the_notebook(cells):
    """Widgets re-run on the warm pool after the last cell; kernel shutdown stops it."""
    source = "\n".join(c.source for c in cells)
    assert "lk.Cluster(4)" in source and "TimelineView(" in source
    assert ".close()" not in source


def test_every_run_is_the_one_training_job(cells):
    """TP and TP+SP go through labkit.train.run with the degrees in RunConfig.parallel; the
    per-part activation count (§7) builds the same job's stages (labkit.train.build)."""
    source = "\n".join(c.source for c in cells)
    assert "from labkit.train import reference, run" in source
    assert "BASE.replace(parallel=dict(tp=tp), sequence_parallel=sp)" in source
    assert "tp_run(2, sp=True)" in source and "tp_run(4, sp=True)" in source
    calls = re.findall(r"cluster\.run\((\w[\w.]*),", source)
    assert calls and set(calls) == {"run", "job_layer_activations"}, calls
