"""The planner against training runs that happened (claim C35).

**Narayanan et al. 2021, Table 1** (GPT 1.7B–1T on up to 3,072 A100s). The planner predicts
each row's per-GPU TFLOP/s (their Eq. 3, recomputation counted) with the table's degrees,
batch and GPU count, the Megatron 2021 runtime (no overlap of TP/PP/DP communication, fp16
gradients, scatter/gather), full recomputation, and its own best microbatch and number of
chunks. Calibration: matmul efficiency 0.859 (A100 MAMF, Bekman), HBM 0.90 and link 0.80
(assumed) — none fitted to the table.

Per-row error (planner / published − 1), as of this commit:

==============  =========  =======  ======
model           published  planner  error
==============  =========  =======  ======
1.7B            137        164      +20.0%
3.6B            138        163      +18.0%
7.5B            142        162      +14.1%
18.4B           135        155      +14.6%
39.1B           138        167      +21.2%
76.1B           140        176      +25.6%
145.6B          148        184      +24.6%
310.1B          155        194      +25.2%
529.6B          163        198      +21.7%
1T              163        201      +23.2%
==============  =========  =======  ======

**Band: every row within −5 % … +30 %; largest miss +25.6 % (76.1B).** The error has one
sign: the planner's kernels run ~20 % faster than Megatron's did in 2021 (the MAMF ceiling
was measured with CUDA 12.1; an effective matmul efficiency near 0.70 would close the gap —
not used, that would be fitting). Divided by the table's median ratio, every row is within
±8 %: the planner reproduces how utilisation changes across the table.

**Dubey et al. 2024 (Llama 3 405B), Table 4**: 430 / 400 / 380 TFLOP/s published; the
planner predicts 400 / 357 / 368 (−7.0 %, −10.9 %, −3.2 %). Band ±15 %.
"""
import statistics

import pytest

from labkit.plan import PLAN_MODELS
from labkit.plan.published import (LLAMA3_TABLE4, NARAYANAN_TABLE1, predict_llama3_row,
                                   predict_megatron_row)


@pytest.fixture(scope="module")
def megatron():
    return [predict_megatron_row(r) for r in NARAYANAN_TABLE1]


def test_table1_transcription_is_self_consistent():
    for r in NARAYANAN_TABLE1:
        assert r.gpus % (r.tp * r.pp) == 0 and r.batch % r.dp == 0
        assert r.percent_peak == round(100 * r.tflops / 312)  # A100: 312 TFLOP/s fp16
        assert PLAN_MODELS[r.model].n_heads == r.heads
    assert [r.gpus for r in NARAYANAN_TABLE1][-1] == 3072
    assert sum(r.tflops * r.gpus for r in NARAYANAN_TABLE1[-1:]) / 1e3 == pytest.approx(
        502, rel=0.01)  # the paper's 502 petaFLOP/s for 1T


def test_c35_megatron_reaches_40_to_52_percent_of_peak(megatron):  # claim C35
    assert all(43 <= r.percent_peak <= 52 for r in NARAYANAN_TABLE1)
    pred = [x["percent_peak"] for x in megatron]
    # the planner sees the trend: the largest models use the GPUs better than the smallest
    assert statistics.mean(pred[-3:]) > statistics.mean(pred[:4])


def test_planner_within_band_of_narayanan_table1(megatron):  # claim C35
    errors = {x["row"].model: x["error"] for x in megatron}
    assert all(-0.05 <= e <= 0.30 for e in errors.values()), errors
    ratio = [1 + e for e in errors.values()]
    med = statistics.median(ratio)
    assert all(abs(q / med - 1) <= 0.08 for q in ratio), ratio
    for x in megatron:  # the planner kept the published degrees and memory fits
        L, r = x["plan"].layout, x["row"]
        assert (L.tp, L.pp, L.dp, L.global_batch, L.checkpoint) == (r.tp, r.pp, r.dp, r.batch,
                                                                    "full")
        assert x["plan"].fits


def test_planner_within_band_of_llama3_table4():
    for row in LLAMA3_TABLE4:
        x = predict_llama3_row(row)
        assert abs(x["error"]) <= 0.15, (row, x["tflops"])
        L = x["plan"].layout
        assert (L.tp, L.cp, L.pp, L.dp) == (row.tp, row.cp, row.pp, row.dp)
        assert L.global_batch * row.seq_len == pytest.approx(16 * 2 ** 20, rel=0.01)
