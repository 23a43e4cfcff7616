"""notebooks/09_expert_parallel.ipynb as stored: what its checked cells expect.

nbval (``make test``) re-runs the notebook and compares each ``# NBVAL_CHECK_OUTPUT`` cell's
output with the stored one. That only proves the output did not change: a stored ``False``
would be compared against a fresh ``False`` and pass. These pure tests read the stored
notebook and check that the expected outputs are the right ones (routing weights
renormalised, kept counts capped, every measured byte equal to its formula, parity, memory
divided by ep: claim C37) and that nothing else is stored.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import nbformat
from notebook_outputs import (assert_only_checked_cells_store_output, checked as _checked,
                              checked_output as _checked_output, text as _text)
import pytest

NB = Path(__file__).resolve().parents[1] / "notebooks" / "09_expert_parallel.ipynb"
E, K, H, TOKENS, RANKS = 4, 2, 64, 128, 4  # tiny-moe on 4 ranks, 2 sequences of 64 each


def _ints(s: str) -> list:
    return [int(v.replace(",", "")) for v in re.findall(r"\d[\d,]*", s)]


def test_every_checked_cell_stores_output_and_no_other_cell_does(cells):
    assert_only_checked_cells_store_output(cells, at_least=8)


def test_stored_expectations_are_passes(cells):
    text = "\n".join(_text(c) for c in _checked(cells))
    assert not re.search(r"\bFalse\b|MISMATCH|\bnan\b|≠", text), text
    assert text.count(": True") == 13


def test_routing_table_is_softmax_top_k_renormalised(cells):
    out = _checked_output(cells, "route(layer.router(x)")
    rows = [line for line in out.splitlines() if line.startswith("'")]
    assert len(rows) == 6
    for line in rows:
        probs = [float(v) for v in re.findall(r"\d\.\d{3}", line.split("[")[0])]
        chosen = [int(v) for v in line.split("[")[1].split("]")[0].split(",")]
        weights = [float(v) for v in line.split("[")[2].split("]")[0].split(",")]
        assert len(probs) == E and sum(probs) == pytest.approx(1, abs=2e-3)   # a softmax
        assert chosen == sorted(range(E), key=lambda e: -probs[e])[:K]       # the top k
        assert sum(weights) == pytest.approx(1, abs=1.5e-3)                   # renormalised
        for e, w in zip(chosen, weights):
            assert w == pytest.approx(probs[e] / sum(probs[c] for c in chosen), abs=2e-3)
    assert "weights == chosen probabilities / their sum: True" in out
    assert "layer output == Σ weight · expert(x), every token: True" in out


def test_imbalance_with_and_without_the_aux_loss(cells):
    out = _checked_output(cells, "late = {w:")
    lines = [line for line in out.splitlines() if line.startswith("aux weight")]
    assert len(lines) == 2 and lines[0].split(":", 1)[1] == lines[1].split(":", 1)[1]  # step 0
    loads = [int(v) for v in lines[0].split("loads at step 0 [")[1].rstrip("]").split(",")]
    assert sum(loads) == RANKS * TOKENS * K
    first = float(re.search(r"per layer \[([\d.]+),", lines[0]).group(1))
    assert first == pytest.approx(max(loads) / (sum(loads) / E), abs=5e-4)
    assert "collapsed (mean imbalance over steps 8-15 >= 1.9 of max 2): True" in out
    assert "lower in every layer: True" in out


def test_capacity_caps_the_kept_choices(cells):
    out = _checked_output(cells, "capacity C = ceil")
    c = math.ceil(1.0 * K * TOKENS / E)
    assert f"capacity C = ceil(1.0 · {K} · {TOKENS} / {E}) = {c}" in out
    assert "kept == min(routed, C): True" in out and "dropped == routed - kept: True" in out
    dropped = _ints(out.split("(layers summed): ")[1].splitlines()[0])
    assert len(dropped) == RANKS and all(0 < d < 2 * TOKENS * K for d in dropped)
    assert "more dropped without the aux loss than with it: True" in out


def test_dispatch_and_combine_bytes_equal_the_formula(cells):  # claim C37
    out = _checked_output(cells, "def dispatch_table")
    assert f"= {3 * K * TOKENS * H * 4 // 4:,} bytes per rank" in out
    rows = [_ints(line) for line in out.splitlines() if re.match(r"\s+\d\s+\d", line)]
    assert [r[0] for r in rows] == list(range(RANKS))
    for _, d_sent, d_sent_f, d_recv, d_recv_f, c_sent, c_sent_f in rows:
        assert (d_sent, d_recv, c_sent) == (d_sent_f, d_recv_f, c_sent_f)
        assert c_sent == d_recv                     # the combine returns what came in
        assert d_sent % (H * 4) == 0 and d_recv % (H * 4) == 0
    assert sum(r[1] for r in rows) == sum(r[3] for r in rows)  # every row sent is received
    assert len({r[1] for r in rows}) > 1                       # uneven from the start
    out = _checked_output(cells, "triples = [")
    assert f"{4 * RANKS * 16} (run, rank, step) triples" in out and out.count(": True") == 2


def test_replayed_frames_are_the_step_in_order(cells):
    out = _checked_output(cells, "a2a_frames(capped[0.0].trace, 0)")
    frames = re.findall(r"layer (\d) (\w+)\s+\((\w+)\)", out)
    assert frames == [("0", "dispatch", "forward"), ("0", "combine", "forward"),
                      ("1", "dispatch", "forward"), ("1", "combine", "forward"),
                      ("1", "combine", "backward"), ("1", "dispatch", "backward"),
                      ("0", "combine", "backward"), ("0", "dispatch", "backward")]
    assert "all-to-all 0: layer 0 dispatch" in out and "all-to-all 7:" in out  # as the slider
    assert "every row of every frame == the formula from the counts: True" in out


def test_parity_and_the_reductions(cells):
    out = _checked_output(cells, "layouts checked")
    assert "layouts checked: 3 |" in out and "within 1e-5 of one process: True" in out
    full, dense = 2 * E * 3 * H * 192, 344_896 - 2 * E * 3 * H * 192
    assert f"4 · {full // 2:,} expert parameters, n = 2: True" in out
    assert f"4 · {dense:,} dense parameters, n = 4: True" in out


def test_expert_memory_per_rank_is_divided_by_ep(cells):  # claim C37
    out = _checked_output(cells, "measure_memory=True")
    full = 2 * E * 3 * H * 192
    assert f"= {full:,}; dense: {344_896 - full:,}" in out
    rows = {r[0]: r[1:] for r in (_ints(line) for line in out.splitlines()
                                  if re.match(r"\s+[124]\s+\d", line))}
    assert sorted(rows) == [1, 2, 4]
    for ep, (n, params, four_n, grads, opt, adam, *_ratio) in rows.items():
        assert n == 344_896 - full + full // ep
        assert params == four_n == grads == 4 * n
        assert opt == adam and (opt - 8 * n) % 4 == 0 and 0 < opt - 8 * n < 400
    assert rows[4][1] / rows[1][1] == pytest.approx(float(out.splitlines()[-1].split()[-1]),
                                                    abs=5e-4)


def test_cites_c37_and_the_cluster_outlives_the_notebook():
    nb = nbformat.read(NB, as_version=4)
    source = "\n".join(c.source for c in nb.cells)
    assert "C37" in source and "lk.Cluster(4)" in source
    assert ".close()" not in source


def test_every_run_is_the_one_training_job():
    """Every training run goes through labkit.train.run, degrees in RunConfig.parallel."""
    source = "\n".join(c.source for c in nbformat.read(NB, as_version=4).cells)
    assert "from labkit import train" in source
    assert "parallel=dict(dp=4, ep=4)" in source and "parallel=dict(dp=4, ep=ep)" in source
    calls = re.findall(r"cluster\.run\((\w[\w.]*),", source)
    assert len(calls) == 4 and set(calls) == {"train.run"}, calls
