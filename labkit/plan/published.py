"""Training runs that really happened, and the planner's prediction for each (claim C35).

**Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC '21, arXiv:2104.04473), Table 1: weak scaling of GPT models from
1.7B to 1T parameters on Selene (DGX A100 80 GB, 8 HDR InfiniBand adapters per server),
vocabulary 51,200, sequence 2,048, fp16, interleaved schedule with scatter/gather, full
activation recomputation (§5.1). "Achieved teraFLOP/s per GPU" counts FLOPs with their
Eq. 3, which includes the recomputed forward pass — a hardware FLOP rate — and is
end-to-end (data loading, optimizer, logging included). Table 1 gives no microbatch size
and no number of model chunks; :func:`predict_megatron_row` lets the planner choose both
(its own best, as the authors tuned theirs), everything else fixed to the table.

**Dubey et al. 2024**, "The Llama 3 Herd of Models", Table 4: Llama 3 405B on H100s,
16M tokens per batch, BF16 MFU.

How close (``tests/test_plan_published.py`` holds the per-row table, before and after):
every Table 1 row within ±10 %, largest miss −6.4 % (529.6B), with the A100 at the 0.626 of
peak that Megatron's 2021 software sustained on one GPU (derived from row 1 alone,
:data:`~labkit.plan.runtime.A100_2021_MATMUL_EFFICIENCY`; at the GPU's best-GEMM MAMF of
0.859 the planner over-predicted every row by 14–26 %). Llama 3's three rows within ±10 %,
largest miss −7.8 % (16,384 GPUs, 8K), with data-parallel traffic hidden in the pipeline
bubble as Llama 3's asynchronous FSDP allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from labkit.plan.estimate import Plan, estimate
from labkit.plan.layout import Layout
from labkit.plan.models import PLAN_MODELS, narayanan_flops

__all__ = ["MegatronRow", "NARAYANAN_TABLE1", "LlamaRow", "LLAMA3_TABLE4",
           "predict_megatron_row", "predict_llama3_row", "MICROBATCH_CHOICES"]

#: microbatch sizes the planner may pick when a publication does not state one
MICROBATCH_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True)
class MegatronRow:
    """One row of Narayanan et al. 2021, Table 1."""

    model: str          # planner preset
    params_b: float     # "Number of parameters (billion)"
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float       # achieved teraFLOP/s per GPU
    percent_peak: int   # "Percentage of theoretical peak FLOP/s"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


NARAYANAN_TABLE1 = (
    MegatronRow("megatron-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    MegatronRow("megatron-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    MegatronRow("megatron-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    MegatronRow("megatron-18b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    MegatronRow("megatron-39b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    MegatronRow("megatron-76b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    MegatronRow("megatron-146b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    MegatronRow("megatron-310b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    MegatronRow("megatron-530b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    MegatronRow("megatron-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


@dataclass(frozen=True)
class LlamaRow:
    """One row of Dubey et al. 2024, Table 4 (Llama 3 405B pre-training)."""

    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq_len: int
    batch_per_dp: int
    tflops: float       # BF16 TFLOPs per GPU

    @property
    def global_batch(self) -> int:
        return self.batch_per_dp * self.dp


LLAMA3_TABLE4 = (
    LlamaRow(8192, 8, 1, 16, 64, 8192, 32, 430),
    LlamaRow(16384, 8, 1, 16, 128, 8192, 16, 400),
    LlamaRow(16384, 8, 16, 16, 8, 131072, 16, 380),
)


def _best(candidates) -> Optional[Plan]:
    fits = [p for p in candidates if p.fits]
    return min(fits, key=lambda p: p.step_time) if fits else None


def _chunks(layers: int, pp: int) -> list[int]:
    """Model chunks ``V`` per pipeline rank the planner may try: divisors of L/pp."""
    if pp == 1:
        return [1]
    per = layers // pp
    return [v for v in range(1, per + 1) if per % v == 0]


def predict_megatron_row(row: MegatronRow, cluster: str = "selene-a100",
                         runtime="megatron-2021") -> dict:
    """The planner's prediction for one Table 1 row (Megatron 2021 runtime, full
    recomputation, no sequence parallelism, ZeRO 0), best over microbatch size and chunks.

    Returns:
        ``{"row", "plan", "tflops", "percent_peak", "error"}``: predicted teraFLOP/s per
        GPU counted with Eq. 3 (:func:`~labkit.plan.models.narayanan_flops`), its share of
        peak, and the relative error against the published figure.
    """
    model = PLAN_MODELS[row.model]
    plans = []
    for b in MICROBATCH_CHOICES:
        if row.batch % (row.dp * b):
            continue
        for v in _chunks(row.layers, row.pp):
            sched = "interleaved" if v > 1 else "1f1b"
            lay = Layout(tp=row.tp, pp=row.pp, dp=row.dp, zero=0, microbatch=b,
                         global_batch=row.batch, schedule=sched, virtual_stages=v,
                         checkpoint="full", sequence_parallel=False)
            try:
                plans.append(estimate(model, cluster, lay, runtime=runtime))
            except ValueError:
                continue
    best = _best(plans)
    if best is None:
        raise ValueError(f"no layout of {row.model} fits on {cluster}")
    tflops = narayanan_flops(model, row.batch) / best.step_time / row.gpus / 1e12
    peak = best.cluster.gpu.peak_flops / 1e12
    return {"row": row, "plan": best, "tflops": tflops, "percent_peak": 100 * tflops / peak,
            "error": tflops / row.tflops - 1}


def predict_llama3_row(row: LlamaRow, cluster: str = "llama3-24k") -> dict:
    """The planner's prediction for one row of Llama 3's Table 4 (Llama 3 runtime, ZeRO-1,
    sequence parallelism), best over microbatch size, chunks and recomputation policy.

    Returns:
        ``{"row", "plan", "tflops", "mfu", "error"}`` with model TFLOP/s per GPU.
    """
    plans = []
    for b in MICROBATCH_CHOICES:
        if row.global_batch % (row.dp * b):
            continue
        for v in (1, 2, 4, 8):
            for ck in ("none", "selective", "full"):
                lay = Layout(tp=row.tp, cp=row.cp, pp=row.pp, dp=row.dp, zero=1, microbatch=b,
                             global_batch=row.global_batch, seq_len=row.seq_len,
                             schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
                             checkpoint=ck)
                try:
                    plans.append(estimate("llama3-405b", cluster, lay, runtime="llama3-2024"))
                except ValueError:
                    continue
    best = _best(plans)
    if best is None:
        raise ValueError(f"no layout of llama3-405b fits for {row}")
    return {"row": row, "plan": best, "tflops": best.tflops_per_gpu, "mfu": best.mfu,
            "error": best.tflops_per_gpu / row.tflops - 1}
