"""What recent models used, laid out by the planner (claim C43).

CS336 Lecture 7 tabulates the parallelism of recent open models: OLMo 7B pure FSDP;
DeepSeek v1 ZeRO-1 with tensor and pipeline parallelism; DeepSeek-V3 ZeRO-1 with 64-way
expert and 16-way pipeline parallelism; Qwen ZeRO-1 + TP + PP and Qwen-MoE ZeRO-1 + EP + PP;
Gemma 2 ZeRO-3 with model parallelism on TPUs; Llama 3 TP 8 + PP + DP (+ CP). Each
:class:`Reported` holds one of them: the model preset (published shape,
:mod:`labkit.plan.models`), a cluster preset, the axes and degrees the report states (where
it gives none, the choices the planner may take on those axes), the batch, what the report
says and, where it gives one, a throughput. :func:`plan_reported` keeps the stated axes
and lets the planner choose only what the report leaves open — microbatch, schedule,
recomputation and unstated degrees — and returns the fastest layout that fits.

The clusters are the reports' where they are described (DeepSeek-V3's 2,048 H800s,
Gemma 2's 6,144-chip TPU v5p slice, Llama 3's 24K H100s); where a report gives no
hardware the lecture's H100 cluster stands in, and the row says so.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

from labkit.plan.estimate import Plan, estimate
from labkit.plan.layout import Layout

__all__ = ["Reported", "RECENT", "plan_reported"]


@dataclass(frozen=True)
class Reported:
    """One training run as its report (and the lecture's table) describes it.

    Attributes:
        model, cluster, runtime: planner presets.
        n_gpus: GPUs (chips) of the run.
        global_batch: sequences per step.
        choices: per axis (``tp, cp, pp, dp, ep, zero``) the degrees allowed: one value
            when the report states it, several when it only names the axis.
        stated: the layout as the report / lecture states it.
        source: where the facts come from.
        reported_tokens_per_gpu_s: throughput the report gives (tokens per second per GPU),
            if any; ``reported_tflops``: model TFLOP/s per GPU, if given.
        note: what is assumed.
        order: the rank order (innermost axis first) where the report places an axis
            other than the default ``[TP, CP, PP, DP]`` does.
    """

    name: str
    model: str
    cluster: str
    n_gpus: int
    global_batch: int
    choices: dict = field(hash=False)
    stated: str
    source: str
    runtime: str = "llama3-2024"
    reported_tokens_per_gpu_s: Optional[float] = None
    reported_tflops: Optional[float] = None
    note: str = ""
    order: Optional[tuple] = None


def _layouts(r: Reported, microbatch=(1, 2, 4), virtual=(2, 4)):
    ch = {"tp": (1,), "cp": (1,), "pp": (1,), "ep": (1,), "zero": (1,), **r.choices}
    extra = {"order": r.order} if r.order else {}
    for tp, cp, pp, ep, z in itertools.product(ch["tp"], ch["cp"], ch["pp"], ch["ep"],
                                               ch["zero"]):
        if r.n_gpus % (tp * cp * pp):
            continue
        dp = r.n_gpus // (tp * cp * pp)
        if "dp" in ch and dp not in ch["dp"]:
            continue
        scheds = [("1f1b", 1)] + ([("interleaved", v) for v in virtual] if pp > 1 else [])
        for b, (sched, v) in itertools.product(microbatch, scheds):
            yield [Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, zero=z, microbatch=b,
                          global_batch=r.global_batch, schedule=sched, virtual_stages=v,
                          checkpoint=ck, **extra) for ck in ("none", "selective", "full")]


def plan_reported(r: Reported) -> dict:
    """The fastest layout of ``r`` that fits, keeping the axes its report states.

    Returns:
        ``{"reported", "plan", "considered", "fitting", "tokens_per_gpu_s",
        "tflops_per_gpu", "error"}`` — ``plan`` ``None`` when nothing fits; ``error`` the
        predicted / reported throughput − 1 where the report gives one.

    Raises:
        ValueError: unknown presets.
    """
    fitting, considered = [], 0
    for policies in _layouts(r):
        for lay in policies:  # cheapest recomputation first; slower ones are dominated
            considered += 1
            try:
                p = estimate(r.model, r.cluster, lay, r.runtime, timing=False, detail=False)
            except ValueError:
                break
            if p.fits:
                fitting.append(lay)
                break
    timed = [estimate(r.model, r.cluster, lay, r.runtime, detail=False) for lay in fitting]
    best: Optional[Plan] = min(timed, key=lambda p: p.step_time) if timed else None
    out = {"reported": r, "plan": None, "considered": considered, "fitting": len(fitting),
           "tokens_per_gpu_s": None, "tflops_per_gpu": None, "error": None}
    if best is None:
        return out
    best = estimate(r.model, r.cluster, best.layout, r.runtime)
    tok = r.global_batch * best.model.seq_len / best.step_time / r.n_gpus
    out.update(plan=best, tokens_per_gpu_s=tok, tflops_per_gpu=best.tflops_per_gpu)
    if r.reported_tokens_per_gpu_s:
        out["error"] = tok / r.reported_tokens_per_gpu_s - 1
    elif r.reported_tflops:
        out["error"] = best.tflops_per_gpu / r.reported_tflops - 1
    return out


_LECTURE = "CS336 (2025) Lecture 7, the table of recent models' parallelism"
_STAND_IN = "the report gives no cluster: the lecture's H100 cluster (cs336-cluster) stands in"

#: the lecture's table, plus Llama 3, as the planner lays them out
RECENT = (
    Reported("OLMo 7B", "olmo-7b", "a100-40gb-256", 256, 2048,
             {"zero": (3,)},
             "FSDP (ZeRO-3 via PyTorch FSDP), no tensor or pipeline parallelism; ~4M-token "
             "batches",
             "Groeneveld et al. 2024 (OLMo) §3: ZeRO via FSDP, mixed precision; " + _LECTURE,
             note="256 A100 40 GB GPUs assumed (the report trained on A100 40 GB and "
                  "MI250X clusters)"),
    Reported("DeepSeek 67B (v1)", "deepseek-67b", "cs336-cluster", 1024, 4608,
             {"tp": (2, 4, 8), "pp": (2, 4, 8), "zero": (1,)},
             "ZeRO-1, tensor (+ sequence) and 1F1B pipeline parallelism (HAI-LLM); degrees "
             "not given; batch 4,608 × 4,096",
             "DeepSeek-AI 2024 (DeepSeek LLM) §2.4 and Table 2; " + _LECTURE,
             note=_STAND_IN + "; 1,024 GPUs assumed"),
    Reported("DeepSeek-V3", "deepseek-v3", "deepseek-h800-2048", 2048, 15360,
             {"pp": (16,), "ep": (64,), "zero": (1,)},
             "16-way pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 "
             "data parallelism, no tensor parallelism; batch 15,360 × 4,096",
             "DeepSeek-AI 2024 (DeepSeek-V3 Technical Report) §3.2 and §4.2; 180K H800 "
             "GPU-hours per trillion tokens (§1) = 1,543 tokens/s per GPU",
             runtime="deepseek-v3-2024",
             reported_tokens_per_gpu_s=1e12 / (180e3 * 3600),
             note="the expert-parallel group is 8 nodes of 8 GPUs (data ranks innermost, "
                  "the pipeline across nodes); its all-to-alls are timed with the report's "
                  "node-limited, once-per-node dispatch (FP8 out, BF16 back) and hidden by "
                  "DualPipe in the steady state at the cost of 20 of 132 SMs; GEMMs counted "
                  "at bf16 MAMF (the report's FP8 GEMMs are not modelled) and multi-head "
                  "latent attention as multi-head attention",
             order=("tp", "cp", "dp", "pp")),
    Reported("Qwen 14B", "qwen-14b", "cs336-cluster", 256, 2048,
             {"tp": (2, 4, 8), "pp": (2, 4), "zero": (1,)},
             "ZeRO-1 + tensor + pipeline parallelism (the lecture's table; the report "
             "gives no degrees); 4M-token batches",
             "Bai et al. 2023 (Qwen Technical Report) Table 1; " + _LECTURE,
             note=_STAND_IN + "; 256 GPUs assumed"),
    Reported("Qwen1.5-MoE-A2.7B", "qwen1.5-moe-a2.7b", "cs336-cluster", 256, 512,
             {"pp": (2, 4), "ep": (4, 8, 16), "zero": (1,)},
             "ZeRO-1 + expert + pipeline parallelism (the lecture's table)",
             "Qwen team 2024 (Qwen1.5-MoE release); " + _LECTURE,
             note=_STAND_IN + "; 256 GPUs and 4M-token batches (512 × 8,192) assumed"),
    Reported("Gemma 2 27B", "gemma2-27b", "tpu-v5p-6144", 6144, 1536,
             {"tp": (8,), "dp": (768,), "zero": (3,)},
             "6,144 TPU v5p chips: 768 data shards × 8 model shards (the report); ZeRO-3 "
             "with model parallelism, no pipeline (the lecture)",
             "Gemma Team 2024 (Gemma 2) §3 and Table 3; " + _LECTURE,
             note="batch not given: 2 sequences of 8,192 per data shard assumed"),
    Reported("Llama 3 405B", "llama3-405b", "llama3-24k", 8192, 2048,
             {"tp": (8,), "pp": (16,), "zero": (1,)},
             "TP 8 inside a server, PP 16 across, DP 64 (FSDP, the weights not re-sharded "
             "after the forward), CP only for long context; 430 TFLOP/s per GPU",
             "Dubey et al. 2024 (The Llama 3 Herd of Models) §3.3.2, Table 4 row 1",
             reported_tflops=430.0,
             note="FSDP that does not re-shard after the forward gathers each weight once a "
                  "step and holds the stage's whole weights through it, as ZeRO-1 does: "
                  "planned as ZeRO-1 (its replicated gradients make the memory an upper "
                  "bound)"),
)
