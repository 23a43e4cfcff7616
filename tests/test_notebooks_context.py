"""notebooks/07_context_parallel.ipynb as stored: what its checked cells expect.

nbval (``make test``) re-runs the notebook and compares each ``# NBVAL_CHECK_OUTPUT`` cell's
output with the stored one. That only proves the output did not change: a stored ``False``
would be compared against a fresh ``False`` and pass. These pure tests read the stored
notebook and check that the expected outputs are the right ones (every measured number
equal to its formula, parity, claims C28 and C29) and that nothing else is stored.
"""
from __future__ import annotations

import re
from pathlib import Path

from notebook_outputs import (assert_only_checked_cells_store_output, checked as _checked,
                              checked_output as _checked_output, text as _text)
import pytest

NB = Path(__file__).resolve().parents[1] / "notebooks" / "07_context_parallel.ipynb"


def test_every_checked_cell_stores_output_and_no_other_cell_does(cells):
    assert_only_checked_cells_store_output(cells, at_least=8)


def test_stored_expectations_are_passes(cells):
    text = "\n".join(_text(c) for c in _checked(cells))
    assert not re.search(r"\bFalse\b|MISMATCH|\bnan\b|≠", text), text


def test_activation_memory_matches_the_count_and_divides_by_cp(cells):
    out = _checked_output(cells, "activations_formula(mc, 2)")
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s", line)]
    assert [r[0] for r in rows] == ["128", "256", "512"]
    assert all(r[1] == r[2] and r[3] == "1.0000" for r in rows)   # measured == formula
    # bytes per token: linear in S (up to the 20 bytes of scalars, 20/(2S) per token)
    assert len({round(float(r[4])) for r in rows}) == 1
    out = _checked_output(cells, 'runs["ring", cp] = cluster.run')
    ratios = {int(line.split()[0]): float(line.split()[-1])
              for line in out.splitlines() if re.match(r"\s*[24]\s", line)}
    assert ratios[2] == pytest.approx(1 / 2, abs=0.005) and ratios[4] == pytest.approx(1 / 4, abs=0.005)


def test_c28_shards_and_ulysses_refusal(cells):  # claim C28
    out = _checked_output(cells, "rank_batch(cfg")
    for r in range(4):
        assert f"rank {r}: tokens (2, 128), hidden (2, 128, 64), chunks ({r}, {7 - r}) of 8" in out
    out = _checked_output(cells, "gqa = ModelConfig")
    assert "ValueError: Ulysses" in out and "cp=4" in out and "accepted" in out


def test_traffic_work_and_parity_equal_their_references(cells):
    out = _checked_output(cells, "every rank's bytes == formula")
    assert out.count("every rank's bytes == formula: True") == 3
    out = _checked_output(cells, "closed form == counted")
    assert out.count("closed form == counted: True") == 2
    assert "imbalance (max/mean) 1.0000" in out and "imbalance (max/mean) 1.74" in out
    out = _checked_output(cells, "runs checked")
    assert "within 1e-5 of one process: True" in out
    out = _checked_output(cells, "cp_alone")
    assert out.count(": True") == 2 and "8 ranks but the cluster has world_size=4" in out


def test_views_replay_the_ring_and_ulysses(cells):
    out = _checked_output(cells, "for v in (view, ulysses)")
    assert out.count("ring step") == 4 and out.count("all-to-all") == 3


def test_c29_tokens_per_gpu_and_the_planner_rows(cells):  # claim C29
    out = _checked_output(cells, "tokens_per_rank(131072, 16)")
    assert "tokens_per_rank(131072, 16) = 8,192" in out
    rows = {line[:12].strip(): line[12:].split() for line in out.splitlines()
            if line.startswith(("8K", "128K"))}
    assert rows["128K, CP 16"][1] == rows["8K, no CP"][1] == "8,192"   # tokens per GPU
    assert rows["128K, CP 16"][2:6] == rows["8K, no CP"][2:6]          # same memory
    assert rows["128K, no CP"][1] == "131,072" and rows["128K, no CP"][2] == "1"


def test_the_cluster_outlives_the_notebook(cells):
    """Widgets re-run on the warm pool after the last cell; kernel shutdown stops it."""
    source = "\n".join(c.source for c in cells)
    assert "lk.Cluster(4)" in source
    assert ".close()" not in source


def test_c45_video_tokens_and_the_vit_activation_check_as_stored(cells):
    """claim C45 as notebook 07 §9 stores it: 7,200 frames × 196 patches = 1,411,200 tokens,
    the planned per-rank bytes halving with every doubling of cp, and the ViT's measured
    bytes per layer equal to the planner's on every rank, cp 1, 2 and 4, with parity."""
    out = _checked_output(cells, "video_tokens(")
    assert "C45: 7,200 frames × 196 patches = 1,411,200 tokens" in out, out
    gib = [float(m.group(2)) for m in re.finditer(r"^\s*(\d+)\s+[\d,]+\s+[\d.]+\s+([\d.]+)$",
                                                   out, re.M)]
    assert len(gib) == 7 and all(abs(a / b - 2) < 0.01 for a, b in zip(gib, gib[1:])), out
    act = _checked_output(cells, "vit_act = {}")
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+\[(\d+)\]\s+(\d+)$", act, re.M)
    assert [r[0] for r in rows] == ["1", "2", "4"], act
    assert all(r[2] == r[3] for r in rows), act
    assert "losses within 1e-5 of one process: True" in act, act
