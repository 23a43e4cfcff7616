"""The lectures' rules of thumb, computed by the planner (claims C27, C34).

* :func:`comm_per_flop` — how much each axis communicates per unit of compute when it alone
  splits the work two ways: bytes each GPU sends per step ÷ FLOPs it computes per step. A
  GPU computing ``F`` FLOP/s needs ``comm_per_flop · F`` bytes/s on that axis's links:
  the bandwidth need the 3-D rule orders TP > CP > PP > DP (CS336 Lecture 7).

  For a dense model of ``Ψ ≈ 12·L·h²`` parameters and ``B·s`` tokens per step the planner's
  accounting gives, at degree 2 (FLOPs per GPU ``3·Ψ·B·s``): TP ``8·h·L/(3Ψ) ≈ 2/(9h)``;
  CP ``2·kv·L/Ψ ≈ kv/(6h²)``; PP ``4h/(3Ψ)``; DP (ZeRO-1, fp32 gradients, bf16 weights:
  ``3Ψ`` bytes) ``1/(B·s)``. So PP needs more than DP only while ``B·s > 3Ψ/(4h) ≈ 9·L·h``
  tokens per step: true for Llama 3 8B and 70B at Llama 3's 16M-token batch, **not** for
  405B (3Ψ/(4h) = 18.6M tokens), whose data-parallel traffic per step (≈ 19 GB a GPU in its
  real layout) exceeds its pipeline traffic (≈ 1 GB). The rule places DP outermost anyway
  because its traffic can overlap the whole backward (Llama 3 §3.3.2), while PP's sits
  between stages.
* :func:`tp_scaling` — throughput per GPU against the tensor-parallel degree, the rest data
  parallel: a few percent per doubling inside the server, then a cliff once the group
  leaves it (HF's measurement in CS336 Lecture 7: −10 %, −10 %, −12 % up to TP 8; −42 % at
  16, −65 % at 32).
* :func:`collective_scaling` — one collective's time and bandwidth as its group grows, on a
  switched GPU cluster or a TPU torus (claim C41): on the GPUs a step at the server
  boundary and, for groups that leave a 256-GPU switch domain sparsely, another at the
  spine; on the torus a rate set by the axes the group spans, no cliff.
"""
from __future__ import annotations

from typing import Iterable, Union

from labkit.plan.estimate import estimate
from labkit.plan.hardware import ClusterSpec, cluster_preset
from labkit.plan.layout import AXES, Layout
from labkit.plan.models import PlanModel, plan_model

__all__ = ["comm_per_flop", "tp_scaling", "collective_scaling"]


def comm_per_flop(model: Union[str, PlanModel], axis: str, seq_len: int, global_batch: int,
                  runtime: str = "llama3-2024", cluster: Union[str, ClusterSpec] = "h100-server",
                  degree: int = 2) -> float:
    """Bytes one GPU sends on ``axis`` per FLOP it computes, with ``axis`` at ``degree``
    and every other axis at 1 (no recomputation, ZeRO-1, microbatch of one sequence).

    Raises:
        ValueError: an unknown axis or a layout the model cannot run.
    """
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    m = plan_model(model, seq_len)
    lay = Layout(**{axis: degree}, zero=1, microbatch=1, global_batch=global_batch,
                 seq_len=seq_len, checkpoint="none")
    p = estimate(m, cluster, lay, runtime, detail=False)
    flops_per_gpu = global_batch * seq_len * m.flops_per_token() / lay.n_gpus
    return p.comm[axis].bytes / flops_per_gpu


def tp_scaling(model: Union[str, PlanModel], cluster: Union[str, ClusterSpec], seq_len: int,
               microbatch: int = 1, tps: Iterable[int] = (1, 2, 4, 8, 16, 32),
               checkpoint: str = "selective", runtime: str = "llama3-2024") -> dict[int, float]:
    """Throughput per GPU at each tensor-parallel degree, relative to the first: ``tp``
    GPUs and nothing else (four microbatches of ``microbatch`` sequences per step), so the
    only communication is the tensor-parallel one. Memory is not checked.

    Raises:
        ValueError: a degree the model's heads or MLP width do not allow, or one larger
            than the cluster.
    """
    out, base = {}, None
    for t in tps:
        lay = Layout(tp=t, zero=1, microbatch=microbatch, global_batch=4 * microbatch,
                     seq_len=seq_len, checkpoint=checkpoint)
        p = estimate(model, cluster, lay, runtime, detail=False)
        rate = lay.global_batch / p.step_time / t
        base = base or rate
        out[t] = rate / base
    return out


def collective_scaling(cluster: Union[str, ClusterSpec], sizes: Iterable[int],
                       collective: str = "all_reduce", size_bytes: float = 1e9,
                       stride: int = 1) -> list[dict]:
    """``collective`` on ``size_bytes`` over groups of each of ``sizes`` ranks, ``stride``
    apart (1: neighbours, as tensor parallelism; a model replica's size: the
    data-parallel group of a layout). One dict per size: ``n``, ``level``, ``bandwidth``
    (bytes/s per GPU before link efficiency), ``slowdown`` (oversubscription),
    ``seconds`` (:func:`labkit.plan.network.collective_time`).

    Raises:
        ValueError: a group larger than the cluster, an unknown collective.
    """
    from labkit.plan.network import collective_time, place
    c = cluster_preset(cluster)
    out = []
    for n in sizes:
        pl = place(c, (int(n), int(stride)))
        out.append({"n": int(n), "level": pl.level, "bandwidth": pl.bandwidth,
                    "slowdown": pl.slowdown,
                    "seconds": collective_time(collective, size_bytes, pl)})
    return out
