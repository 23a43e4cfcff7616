"""Time of one training step of a layout: compute, each axis's communication, the bubble.

Per microbatch on pipeline rank ``i``: its ``layers_i`` layers' forward, backward and
recomputation (:mod:`labkit.plan.compute`), the output head on the last rank, and the
exposed part of

* **TP** (Megatron's f/g, Shoeybi et al. 2019 §3; Korthikanti et al. 2022 §4.2.2): per layer
  2 all-reduces of the ``2·b·s·h``-byte activation forward and 2 backward — or, with
  sequence parallelism, 2 all-gathers + 2 reduce-scatters of the same volume each way;
  full recomputation repeats the forward's.
* **CP** (Llama 3 §3.3.2): per layer an all-gather of K and V of the whole sequence forward,
  again backward (and in recomputation), and a reduce-scatter of their gradients.
* **EP** (GShard, Lepikhin et al. 2020 §3.2): per mixture-of-experts layer and microbatch
  the dispatch and combine all-to-alls, forward, backward and in recomputation
  (:func:`labkit.plan.experts.expert_all_to_all_time`). A runtime that overlaps them
  (``ep_overlap``: DeepSeek-V3's DualPipe pairs a forward chunk with a backward chunk,
  §3.2.1) hides them behind the layer's compute only where chunks pair: not in the
  pipeline's warm-up and cool-down, ``(p−1)/m`` of a rank's chunks, whose all-to-alls
  stay exposed. The SMs that run the communication kernels meanwhile are lost to compute
  (``comm_sm_fraction``).
* **PP**: per microbatch and model chunk, the activation forward and its gradient backward
  to the neighbour rank (``2·b·s·h/t`` bytes with sequence parallelism or Megatron's
  scatter/gather, §4.1), ``2·V`` transfers per microbatch.

The slowest rank sets the pace: the pipeline takes ``(m + (p−1)/V) · t_microbatch``
(Narayanan et al. 2021 §2.2). After it, the exposed **DP** traffic over the ``dp·cp`` ranks
that share weights: ZeRO-0 an all-reduce of the gradients; ZeRO-1 a reduce-scatter of the
gradients and an all-gather of the weights per step; ZeRO-2 the reduce-scatter per
microbatch (gradients stay sharded while they accumulate); ZeRO-3 per microbatch and per
layer (FSDP's unit) two all-gathers of the weights and one reduce-scatter (ZeRO §5.3) —
each paying the collective's latency, which grows with the group — plus for HSDP an
all-reduce of the shard across replicas once per step. Overlap is the runtime's fraction times the compute
that can hide it; a once-per-step collective may also hide in the pipeline's idle time,
``(p−1)/V`` microbatch-times per rank and step (its bubble: the gradients' reduce-scatter in
the cool-down, the weights' all-gather in the next warm-up), as Llama 3's asynchronous FSDP
does. Hidden or not, every byte that leaves the server goes through the GPU's
network adapter: the step takes at least those bytes over its bandwidth (the axes share
it). Last, the optimizer step, HBM-bound.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from labkit.plan.compute import head_ops, layer_ops, ops_flops, ops_time
from labkit.plan.experts import expert_all_to_all_time
from labkit.plan.network import collective_time, place
from labkit.plan.runtime import ADAM_BYTES_PER_PARAM, LINK_EFFICIENCY, MEMORY_EFFICIENCY

__all__ = ["AxisTime", "StepTime", "step_time", "layer_times"]


@dataclass(frozen=True)
class AxisTime:
    """One axis's communication per GPU and step: seconds (not overlapped), the exposed
    part, bytes sent, the hierarchy level and bandwidth, what it runs, and the bytes that
    leave the server through this GPU's network adapter (``bytes / per-server members``
    when the group crosses servers)."""

    degree: int
    level: str
    bandwidth: float
    desc: str
    seconds: float
    exposed: float
    bytes: float
    nic_bytes: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """Times in seconds (per layer and microbatch for ``t_f``, ``t_b``, ``t_rc``)."""

    t_f: float
    t_b: float
    t_rc: float
    t_head: float
    stage: tuple
    slow: int
    t_mb: float
    t_pipe: float
    bubble: float
    axes: dict
    t_opt: float
    step: float
    recompute_flops_per_token: float
    t_nic: float = 0.0


@functools.lru_cache(maxsize=4096)
def layer_times(model, gpu, b: int, s_local: int, s_kv: int, tp: int, sp: bool,
                ep: int = 1) -> dict:
    """Forward/backward seconds of one layer and of its attention core, the layer's
    forward FLOPs (whole and core), and the head's forward+backward seconds."""
    ops = layer_ops(model, b, s_local, s_kv, tp, sp, ep)
    head = head_ops(model, b, s_local, tp, sp)
    return {"f": ops_time(ops, gpu), "b": ops_time(ops, gpu, backward=True),
            "core_f": ops_time(ops, gpu, core_only=True),
            "core_b": ops_time(ops, gpu, backward=True, core_only=True),
            "flops": ops_flops(ops), "core_flops": ops_flops(ops, core_only=True),
            "head": ops_time(head, gpu) + ops_time(head, gpu, backward=True)}


def _exposed(seconds: float, overlap: float, window: float) -> float:
    return max(0.0, seconds - overlap * window)


def _none(degree: int = 1) -> AxisTime:
    return AxisTime(degree, "hbm", float("inf"), "none", 0.0, 0.0, 0.0)


def step_time(model, cluster, layout, runtime, layers: list[int], params: list[float]
              ) -> StepTime:
    """The :class:`StepTime` of ``layout`` (already checked) with ``layers`` and
    ``params`` per pipeline rank."""
    gpu, s, t, p, v = (runtime.gpu(cluster.gpu), model.seq_len, layout.tp, layout.pp,
                       layout.virtual_stages)
    b, mb, sp, r, z = layout.microbatch, layout.microbatches, layout.sp, runtime, layout.zero
    s_loc = s // layout.cp
    T = b * s_loc
    lt = layer_times(model, gpu, b, s_loc, s, t, sp, getattr(layout, "ep", 1))
    # SMs held by communication kernels leave the rest to compute
    slow_sm = 1.0 / (1.0 - r.comm_sm_fraction)
    t_f, t_b, t_head = lt["f"] * slow_sm, lt["b"] * slow_sm, lt["head"] * slow_sm
    t_rc = {"none": 0.0, "selective": lt["core_f"], "full": lt["f"]}[layout.checkpoint] \
        * slow_sm
    act = 2.0 * T * model.d_model

    # tensor parallelism, per layer and microbatch
    tp_pl = place(cluster, (t, layout.stride("tp")))
    passes = 2 + (layout.checkpoint == "full")  # forward, backward (+ recomputed forward)
    if t > 1:
        if sp:
            one = collective_time("all_gather", act, tp_pl) + collective_time(
                "reduce_scatter", act, tp_pl)
            desc = "2 all-gather + 2 reduce-scatter of 2·b·s·h per layer each way"
        else:
            one = collective_time("all_reduce", act, tp_pl)
            desc = "2 all-reduce of 2·b·s·h per layer each way"
        tp_s, tp_bytes = 2 * passes * one, 2 * passes * 2 * (t - 1) / t * act
    else:
        tp_s = tp_bytes = 0.0
    tp_x = _exposed(tp_s, r.tp_overlap, t_f + t_b)

    # context parallelism, per layer and microbatch
    cp, kv_loc = layout.cp, max(model.kv_dim / t, model.head_dim)
    cp_pl = place(cluster, (cp, layout.stride("cp")))
    kv = 2.0 * 2 * b * s * kv_loc
    if cp > 1:
        n_ag = 2 + (layout.checkpoint != "none")
        cp_s = n_ag * collective_time("all_gather", kv, cp_pl) + collective_time(
            "reduce_scatter", kv, cp_pl)
        cp_bytes = (n_ag + 1) * (cp - 1) / cp * kv
    else:
        cp_s = cp_bytes = 0.0
    cp_x = _exposed(cp_s, r.cp_overlap, lt["core_f"] + lt["core_b"])

    # expert parallelism, per MoE layer and microbatch; chunks pair (and hide their
    # all-to-alls) only in the pipeline's steady state
    a2a = expert_all_to_all_time(model, cluster, layout, r) if model.moe else None
    ep_s = a2a["seconds"] if a2a else 0.0
    unpaired = min(1.0, (p - 1) / mb) if r.ep_overlap and p > 1 else 0.0
    ep_x = unpaired * ep_s + (1 - unpaired) * _exposed(ep_s, r.ep_overlap, t_f + t_b + t_rc)

    # pipeline parallelism, per microbatch
    pair = place(cluster, (min(p, 2), layout.stride("pp")))
    msg = act / (t if (sp or r.pp_scatter_gather) else 1)
    if p > 1:
        one = collective_time("send_recv", msg, pair)
        if r.pp_scatter_gather and not sp and t > 1:
            one += collective_time("all_gather", act, tp_pl)
        pp_s, pp_bytes = 2 * v * one, 2 * v * msg
    else:
        pp_s = pp_bytes = 0.0

    stage, pp_x = [], []
    for i in range(p):
        compute = layers[i] * (t_f + t_b + t_rc) + (t_head if i == p - 1 else 0.0)
        pp_x.append(_exposed(pp_s, r.pp_overlap, compute))
        stage.append(compute + layers[i] * (tp_x + cp_x + ep_x) + pp_x[i])
    slow = max(range(p), key=lambda i: stage[i])
    t_mb = stage[slow]
    t_pipe = (mb + (p - 1) / v) * t_mb
    bubble = ((p - 1) / v) / (mb + (p - 1) / v)

    # the pipeline's idle time: a rank waits (p−1)/V microbatch-times per step, in the
    # warm-up before its first forward and the cool-down after its last backward; the
    # gradients' reduce-scatter can run in the cool-down, the weights' all-gather for the
    # next step in the warm-up (as zero-bubble schedules fill the bubble with W)
    idle = (p - 1) / v * t_mb
    dp = _data_parallel(cluster, layout, runtime, params[slow], layers[slow] * t_f,
                        layers[slow] * t_b, t_mb, layers[slow], idle)
    P_opt = params[slow] / ((layout.shard_group if z == 3 else layout.dp * cp) if z else 1)
    t_opt = P_opt * ADAM_BYTES_PER_PARAM / (MEMORY_EFFICIENCY * gpu.hbm_bandwidth)
    n = mb * layers[slow]
    axes = {"tp": AxisTime(t, tp_pl.level, tp_pl.bandwidth, desc if t > 1 else "none",
                           n * tp_s, n * tp_x, n * tp_bytes),
            "cp": AxisTime(cp, cp_pl.level, cp_pl.bandwidth,
                           "all-gather K,V forward, backward (and in recomputation); "
                           "reduce-scatter dK,dV; per layer" if cp > 1 else "none",
                           n * cp_s, n * cp_x, n * cp_bytes),
            "pp": AxisTime(p, pair.level, pair.bandwidth,
                           f"send activation forward, gradient backward; {v} chunk(s) per "
                           "microbatch" if p > 1 else "none",
                           mb * pp_s, mb * pp_x[slow], mb * pp_bytes),
            "dp": dp}
    axes = {k: _with_nic(a, cluster, layout, k) for k, a in axes.items()}
    if a2a and a2a["placement"].size > 1:
        pl = a2a["placement"]
        axes["ep"] = AxisTime(pl.size, pl.level, min(pl.inside_bandwidth, pl.nic_bandwidth),
                              "all-to-all dispatch + combine per MoE layer, forward, backward"
                              " (and in recomputation)", n * ep_s, n * ep_x,
                              n * a2a["bytes"], n * a2a["across_bytes"])
    else:
        axes["ep"] = _none(getattr(layout, "ep", 1))
    nic = sum(a.nic_bytes for a in axes.values())
    t_nic = nic / (cluster.levels[1].bandwidth * LINK_EFFICIENCY) if len(cluster.levels) > 1 \
        else 0.0
    rc_flops = {"none": 0.0, "selective": lt["core_flops"], "full": lt["flops"]}[
        layout.checkpoint] * t / T * model.n_layers
    step = max(t_pipe + dp.exposed, t_nic) + t_opt
    return StepTime(t_f, t_b, t_rc, t_head, tuple(stage), slow, t_mb, t_pipe, bubble,
                    axes, t_opt, step, rc_flops, t_nic)


def _with_nic(a: AxisTime, cluster, layout, axis: str) -> AxisTime:
    """``a`` with the bytes its group sends through this GPU's network adapter."""
    if a.level in ("hbm", cluster.levels[0].name):
        return a
    if axis == "dp":
        pl = place(cluster, (layout.cp, layout.stride("cp")), (layout.dp, layout.stride("dp")))
    elif axis == "pp":
        pl = place(cluster, (2, layout.stride("pp")))
    else:
        pl = place(cluster, (a.degree, layout.stride(axis)))
    return replace(a, nic_bytes=a.bytes / pl.per_server)


def _data_parallel(cluster, layout, r, P: float, win_f: float, win_b: float, t_mb: float,
                   units: int = 1, idle: float = 0.0) -> AxisTime:
    """Data-parallel (ZeRO) traffic of a rank holding ``P`` parameters in ``units`` FSDP
    units (its layers), per step. Once-per-step collectives may hide behind the last
    microbatch's compute and the pipeline's ``idle`` seconds (its bubble, split between
    the cool-down, for gradients, and the next step's warm-up, for weights)."""
    cp, dp, z, mb = layout.cp, layout.dp, layout.zero, layout.microbatches
    n = dp * cp
    if n == 1:
        return _none()
    g = r.grad_bytes * P
    if z < 3:
        pl = place(cluster, (cp, layout.stride("cp")), (dp, layout.stride("dp")))
        if z == 0:
            sec = collective_time("all_reduce", g, pl)
            return AxisTime(n, pl.level, pl.bandwidth, "all-reduce of the gradients per step",
                            sec, _exposed(sec, r.dp_overlap, win_f + win_b + idle),
                            2 * (n - 1) / n * g)
        rs = collective_time("reduce_scatter", g, pl)
        ag = collective_time("all_gather", 2 * P, pl)
        if z == 1:
            return AxisTime(n, pl.level, pl.bandwidth,
                            "reduce-scatter of the gradients, all-gather of the weights, "
                            "per step", rs + ag,
                            _exposed(rs + ag, r.dp_overlap, win_f + win_b + idle),
                            (n - 1) / n * (g + 2 * P))
        return AxisTime(n, pl.level, pl.bandwidth,
                        "reduce-scatter of the gradients per microbatch, all-gather of the "
                        "weights per step", mb * rs + ag,
                        mb * _exposed(rs, r.dp_overlap, win_b)
                        + _exposed(ag, r.dp_overlap, win_f + idle),
                        (n - 1) / n * (mb * g + 2 * P))
    K = layout.shard_group
    pl = place(cluster, (cp, layout.stride("cp")), (K // cp, layout.stride("dp")))
    # FSDP gathers and reduces one layer (unit) at a time: every unit pays the latency
    per_mb = units * (2 * collective_time("all_gather", 2 * P / units, pl)
                      + collective_time("reduce_scatter", g / units, pl))
    sec, exposed = mb * per_mb, mb * _exposed(per_mb, r.dp_overlap, t_mb)
    sent = mb * (K - 1) / K * (4 * P + g)
    desc = "per microbatch: all-gather of the weights forward and backward, reduce-scatter " \
           "of the gradients (ZeRO-3)"
    level, bw = pl.level, pl.bandwidth
    R = n // K
    if R > 1:
        rep = place(cluster, (R, layout.stride("dp") * (K // cp)))
        extra = collective_time("all_reduce", g / K, rep)
        sec += extra
        exposed += _exposed(extra, r.dp_overlap, win_b + idle)
        sent += 2 * (R - 1) / R * g / K
        desc += f"; all-reduce of the shard across {R} replicas per step (HSDP)"
        if rep.crosses_servers:
            level, bw = rep.level, min(bw, rep.bandwidth)
    return AxisTime(n, level, bw, desc, sec, exposed, sent)
