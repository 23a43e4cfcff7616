"""The planner's calibration constants and what a training implementation overlaps.

Few and named; none is fitted to the published runs the planner is checked against
(:mod:`labkit.plan.published`):

=====================  =====  ==============================================================
constant               value  source
=====================  =====  ==============================================================
matmul efficiency      0.801  H100 SXM, MAMF 792.1 / 989 TFLOP/s (S. Bekman, ml-engineering,
                       0.859  "Maximum Achievable Matmul FLOPS" table); A100 SXM 267.9 / 312.
                              Stored on the :class:`~labkit.plan.hardware.GPU`.
MEMORY_EFFICIENCY      0.90   assumed: a streaming kernel (norm, softmax, dropout, Adam)
                              reaches ~90 % of the HBM datasheet bandwidth.
LINK_EFFICIENCY        0.80   assumed: NCCL's bus bandwidth reaches ~80 % of the nominal
                              per-direction link rate (the same ceiling MAMF finds for
                              matmuls). Not measured here: labkit's machine has no NVLink.
hop latencies          µs     NCCL's tuning model (src/graph/tuning.cc), see
                              :mod:`labkit.plan.hardware`.
A100_2021_MATMUL_EFF.  0.626  the fraction of the A100's 312 TFLOP/s that Megatron-LM's 2021
                              software stack (PyTorch 1.8, cuBLAS 11, its fused kernels)
                              sustained on one GPU, end to end: derived once from Narayanan
                              et al. 2021 Table 1 row 1 (1.7B, no tensor or pipeline
                              parallelism, 32 GPUs whose gradient all-reduce is ~1 % of the
                              step), the only row where a GPU computes alone; the nine
                              other rows are predictions. ``tests/test_plan_published.py``
                              re-derives it.
=====================  =====  ==============================================================

**Achieved against the best matmul.** The GPU's MAMF (its ``matmul_efficiency``) is the
best GEMM over a sweep of shapes with 2024 libraries. A :class:`Runtime` may replace it with
what its implementation achieved (``matmul_efficiency``): one constant per GPU type and
software era, not per run. Megatron-LM 2021 on A100s reached 0.626 of peak where MAMF says
0.859 (kernel-launch gaps, unfused element-wise work, data loading and logging are in the
end-to-end figure); Llama 3's 2024 stack on H100s is taken at MAMF (0.801), and its three
rows of Table 4 land within ±10 % with it.

A :class:`Runtime` records what an implementation does, each field from its paper:
which communication it overlaps with compute (0 = exposed, 1 = hidden as far as the compute
window allows), the bytes of a weight, a gradient and Adam's state per parameter, whether
ZeRO shards the expert parameters, and Megatron's scatter/gather of pipeline sends.
``labkit-fp32`` is labkit's own training job at ``precision="fp32"``, so the planner's
per-rank model state can be held against a real run.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

__all__ = ["MEMORY_EFFICIENCY", "LINK_EFFICIENCY", "ADAM_BYTES_PER_PARAM", "Runtime",
           "RUNTIMES", "runtime_preset", "A100_2021_MATMUL_EFFICIENCY"]

MEMORY_EFFICIENCY = 0.90
LINK_EFFICIENCY = 0.80
#: HBM bytes one Adam step moves per parameter: fp32 master, m and v read and written
#: (3·8), the gradient read, the 16-bit weight written (Kingma & Ba 2015; mixed precision
#: as in Micikevicius et al. 2018).
ADAM_BYTES_PER_PARAM = 24 + 2
#: A100 under Megatron-LM's 2021 software, end to end (see the table above).
A100_2021_MATMUL_EFFICIENCY = 0.626


@dataclass(frozen=True)
class Runtime:
    """What the training implementation overlaps and stores.

    Attributes:
        name: preset name.
        grad_bytes: bytes of one gradient element, kept and reduced (2: fp16/bf16; 4: fp32
            accumulation and reduction).
        tp_overlap, cp_overlap, pp_overlap, dp_overlap: fraction of each axis's
            communication that can hide behind compute (0 exposed … 1 hidden up to the
            compute available).
        pp_scatter_gather: each tensor-parallel rank sends only its ``1/t`` slice of a
            pipeline activation and the receiver all-gathers it over NVLink
            (Narayanan et al. 2021, §4.1).
        source: where these facts come from.
        param_bytes: bytes of one stored weight (2: 16-bit weights of mixed precision;
            4: fp32).
        optimizer_bytes: Adam's bytes per parameter (12: fp32 master, m, v; 8: m and v over
            fp32 weights).
        matmul_efficiency: ``((gpu name, fraction of peak), ...)``: what this
            implementation's GEMMs achieved on each GPU type it ran on; a GPU not listed
            runs at its MAMF (:attr:`labkit.plan.hardware.GPU.matmul_efficiency`).
        ep_overlap: fraction of the expert all-to-all (dispatch and combine) that can hide
            behind compute (0: the dispatcher blocks the compute stream, as labkit's and
            Megatron-Core's all-to-all dispatchers do).
        a2a_widths: ``(dispatch, combine)`` bytes per element of the expert all-to-all's
            two directions (dispatch: forward tokens and the backward's output gradients
            to the experts; combine: forward expert outputs and the backward's input
            gradients back); ``()`` = the compute width (2, or 4 at fp32).
        a2a_node_dedup: a token bound for several experts on one server crosses the
            network once and is forwarded inside the server (DeepSeek-V3 §3.2.2).
        comm_sm_fraction: share of the GPU's SMs that run communication kernels while
            compute runs on the rest (the compute slows by ``1/(1 − fraction)``).
        zero_shards_experts: with ``ep > 1``, ZeRO shards the expert parameters' state over
            their expert-data group (``dp·cp/ep`` ranks), as Megatron-Core's distributed
            optimizer does; ``False``: it leaves them whole on each rank (labkit's job keeps
            them out of its flat units and all-reduces their gradients over that group).
    """

    name: str
    grad_bytes: int
    tp_overlap: float
    cp_overlap: float
    pp_overlap: float
    dp_overlap: float
    pp_scatter_gather: bool
    source: str
    param_bytes: int = 2
    optimizer_bytes: int = 12
    zero_shards_experts: bool = True
    matmul_efficiency: tuple = ()
    ep_overlap: float = 0.0
    a2a_widths: tuple = ()
    a2a_node_dedup: bool = False
    comm_sm_fraction: float = 0.0

    def gpu(self, gpu):
        """``gpu`` with this implementation's achieved matmul efficiency, if it has one."""
        eff = dict(self.matmul_efficiency).get(gpu.name)
        return gpu if eff is None else replace(gpu, matmul_efficiency=eff)


RUNTIMES: dict[str, Runtime] = {
    "megatron-2021": Runtime(
        "megatron-2021", grad_bytes=2, tp_overlap=0.0, cp_overlap=0.0, pp_overlap=0.0,
        dp_overlap=0.0, pp_scatter_gather=True,
        matmul_efficiency=(("A100-SXM-80GB", A100_2021_MATMUL_EFFICIENCY),),
        source="Narayanan et al. 2021 (Megatron-LM, PTD-P): fp16 mixed precision; tensor-"
               "parallel all-reduces and pipeline send/recv block the compute stream; the "
               "data-parallel gradient all-reduce runs after the last microbatch's backward; "
               "scatter/gather of pipeline activations (§4.1); GEMMs at 0.626 of the A100's "
               "peak (A100_2021_MATMUL_EFFICIENCY)"),
    "llama3-2024": Runtime(
        "llama3-2024", grad_bytes=4, tp_overlap=0.0, cp_overlap=0.0, pp_overlap=0.0,
        dp_overlap=1.0, pp_scatter_gather=False,
        source="Dubey et al. 2024 (Llama 3) §3.3.2: FP32 gradient accumulation and FP32 "
               "reduce-scatter; data parallelism (FSDP) outermost because it prefetches "
               "weights and reduces gradients asynchronously; the all-gather of context-"
               "parallel K/V is exposed on the critical path; tensor- and pipeline-parallel "
               "transfers taken as blocking (the paper does not say otherwise)"),
    "deepseek-v3-2024": Runtime(
        "deepseek-v3-2024", grad_bytes=4, tp_overlap=0.0, cp_overlap=0.0, pp_overlap=1.0,
        dp_overlap=1.0, pp_scatter_gather=False, ep_overlap=1.0, a2a_widths=(1, 2),
        a2a_node_dedup=True, comm_sm_fraction=20 / 132,
        source="DeepSeek-AI 2024 (DeepSeek-V3 Technical Report): DualPipe (§3.2.1) pairs a "
               "forward and a backward chunk so that both all-to-alls and the pipeline "
               "sends hide behind compute; the all-to-all kernels run on 20 of the H800's "
               "132 SMs (§3.2.2), and a token crosses InfiniBand once per target node, then "
               "NVLink; dispatch in FP8, combine in BF16 (§3.3.2); FP32 gradient "
               "accumulation; Adam state counted as for Llama 3 (the report's BF16 moments "
               "are not modelled)"),
    "labkit-fp32": Runtime(
        "labkit-fp32", grad_bytes=4, tp_overlap=0.0, cp_overlap=0.0, pp_overlap=0.0,
        dp_overlap=1.0, pp_scatter_gather=False, param_bytes=4, optimizer_bytes=8,
        zero_shards_experts=False,
        source="labkit's training job (labkit.train) at precision='fp32': fp32 weights and "
               "gradients, AdamW's m and v (no master copy); with ep > 1 the experts stay "
               "out of ZeRO's flat units; DDP buckets overlap the backward"),
}


def runtime_preset(runtime: Union[str, Runtime]) -> Runtime:
    """The named :class:`Runtime` (or ``runtime`` itself).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if isinstance(runtime, Runtime):
        return runtime
    try:
        return RUNTIMES[str(runtime)]
    except KeyError:
        raise ValueError(f"unknown runtime {runtime!r}; known: "
                         f"{', '.join(sorted(RUNTIMES))}") from None
