"""The planner against training runs that happened (claim C35).

**Narayanan et al. 2021, Table 1** (GPT 1.7B–1T on up to 3,072 A100s). The planner predicts
each row's per-GPU TFLOP/s (their Eq. 3, recomputation counted) with the table's degrees,
batch and GPU count, the Megatron 2021 runtime (no overlap of TP/PP/DP communication, fp16
gradients, scatter/gather), full recomputation, and its own best microbatch and number of
chunks. Calibration: HBM 0.90 and link 0.80 (assumed), and one constant for the A100 under
Megatron's 2021 software, ``A100_2021_MATMUL_EFFICIENCY`` = 0.626 of peak, derived from row
1 alone (1.7B: no tensor or pipeline parallelism, the gradient all-reduce ~1 % of the step —
what one GPU sustained) and re-derived below. The nine other rows are predictions.

Per-row error (planner / published − 1), before (MAMF 0.859, the GPU's best GEMM with 2024
libraries) and after (0.626 from row 1):

==============  =========  ======  =======  ======
model           published  before  planner  error
==============  =========  ======  =======  ======
1.7B            137        +20.0%  137.0    −0.0% (calibrates)
3.6B            138        +18.0%  135.2    −2.0%
7.5B            142        +14.1%  133.7    −5.8%
18.4B           135        +14.6%  128.2    −5.0%
39.1B           138        +21.2%  136.1    −1.4%
76.1B           140        +25.6%  141.2    +0.8%
145.6B          148        +24.6%  146.3    −1.1%
310.1B          155        +25.2%  151.4    −2.4%
529.6B          163        +21.7%  152.6    −6.4%
1T              163        +23.2%  152.9    −6.2%
==============  =========  ======  =======  ======

**Band: every row within ±10 %; largest miss −6.4 % (529.6B).** The constant moves every
row alike; that rows 2–10 then fall within ±7 % is the test of the rest of the model (tensor-
parallel all-reduces, pipeline sends and bubble, data-parallel all-reduce).

**Dubey et al. 2024 (Llama 3 405B), Table 4**: 430 / 400 / 380 TFLOP/s published. Before:
400 / 357 / 368 (−7.0 %, −10.9 %, −3.2 %); after: 408 / 369 / 368 (−5.2 %, −7.8 %, −3.2 %).
What changed: a pipeline rank idles ``(p−1)/V`` microbatch-times per step (its bubble, in
the warm-up and the cool-down), and Llama 3's asynchronous FSDP reduce-scatter and all-gather
run in that idle time instead of after the last backward (:mod:`labkit.plan.steptime`).
H100s stay at MAMF (0.801). Band ±10 %.
"""
import dataclasses
import statistics

import pytest

from labkit.plan import PLAN_MODELS
from labkit.plan.published import (LLAMA3_TABLE4, NARAYANAN_TABLE1, predict_llama3_row,
                                   predict_megatron_row)
from labkit.plan.runtime import A100_2021_MATMUL_EFFICIENCY, RUNTIMES

BAND = 0.10  # every published row within ±10 %


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
    assert all(abs(e) <= BAND for e in errors.values()), errors
    assert abs(errors["megatron-1.7b"]) < 0.005  # the calibrating row
    for x in megatron:  # the planner kept the published degrees and memory fits
        L, r = x["plan"].layout, x["row"]
        assert (L.tp, L.pp, L.dp, L.global_batch, L.checkpoint) == (r.tp, r.pp, r.dp, r.batch,
                                                                    "full")
        assert x["plan"].fits


def test_a100_2021_efficiency_is_row_1_alone():  # claim C35
    """Re-derive the constant: the efficiency at which the planner matches Table 1's 1.7B
    row (bisection), and check the runtime carries it for A100s only."""
    row = NARAYANAN_TABLE1[0]
    assert (row.tp, row.pp) == (1, 1)
    lo, hi = 0.3, 1.0
    for _ in range(14):
        mid = (lo + hi) / 2
        rt = dataclasses.replace(RUNTIMES["megatron-2021"],
                                 matmul_efficiency=(("A100-SXM-80GB", mid),))
        if predict_megatron_row(row, runtime=rt)["error"] > 0:
            hi = mid
        else:
            lo = mid
    assert mid == pytest.approx(A100_2021_MATMUL_EFFICIENCY, abs=0.002)
    assert dict(RUNTIMES["megatron-2021"].matmul_efficiency) == {
        "A100-SXM-80GB": A100_2021_MATMUL_EFFICIENCY}
    assert RUNTIMES["llama3-2024"].matmul_efficiency == ()  # H100s at MAMF


def test_planner_within_band_of_llama3_table4():
    for row in LLAMA3_TABLE4:
        x = predict_llama3_row(row)
        assert abs(x["error"]) <= BAND, (row, x["tflops"])
        L = x["plan"].layout
        assert (L.tp, L.cp, L.pp, L.dp) == (row.tp, row.cp, row.pp, row.dp)
        assert L.global_batch * row.seq_len == pytest.approx(16 * 2 ** 20, rel=0.01)


def test_tp_beyond_the_server_beside_the_lecture():  # claims C27, C35
    """The lecture's measured throughput per GPU (HF's scaling tutorial): 0.88 of ideal at
    TP 8, 0.58 at TP 16, 0.35 at TP 32. The planner (GPT-3 175B, NCCL's one ring per
    network adapter) lands within 0.1 of each past the server; notebook 06's one-link
    model (every byte through one GPU's adapter, 0.2 at TP 16) is a lower bound on it."""
    from labkit.plan.rules import tp_scaling
    from labkit.plan.tp_scaling import tp_scaling_curve

    lecture = {8: 0.88, 16: 0.58, 32: 0.35}
    planner = tp_scaling("gpt3-175b", "llama3-24k", 2048, microbatch=4)
    one_link = {r["tp"]: r["efficiency"] for r in tp_scaling_curve(hidden=8192, seq=4096)}
    for t in (16, 32):
        assert abs(planner[t] - lecture[t]) <= 0.10, (t, planner[t])
        assert one_link[t] < planner[t] and one_link[t] < lecture[t] - 0.2
