"""One layout on one cluster: memory per GPU, communication per axis, bubble, step time, MFU.

:func:`estimate` returns a :class:`Plan` whose ``terms`` name every number with its formula
and source, so a notebook can print the derivation:

* **memory** of each pipeline rank by category (:func:`labkit.plan.memory.rank_memory`):
  parameters, gradients, Adam state under the ZeRO stage (with experts: ``E/ep`` of each
  block's experts per rank, their state sharded over ``ep`` and, if the runtime's ZeRO
  covers them, over their expert-data group; the rest over the ZeRO group); activations
  with the chosen recomputation and the schedule's microbatches in flight
  (:mod:`labkit.plan.activations`); communication buffers. The fullest rank decides
  whether the layout fits.
* **time** of a step (:mod:`labkit.plan.steptime`): per-layer roofline compute, each axis's
  collectives on the hierarchy level its group spans (:mod:`labkit.plan.network`), the
  pipeline bubble, the exposed data-parallel traffic, the optimizer.
* **all-to-all bytes** of each mixture-of-experts layer under ``ep > 1``
  (:func:`labkit.plan.comm.expert_all_to_all_bytes`, balanced routing), in ``terms``.
* **MFU** (Chowdhery et al. 2022, Appendix B) = model FLOPs per step / (step time · GPUs ·
  peak), model FLOPs from :meth:`PlanModel.flops_per_token`; **HFU** adds recomputation
  (Korthikanti et al. 2022 §6).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from labkit.plan.activations import activation_bytes_per_rank
from labkit.plan.experts import expert_params, expert_terms
from labkit.plan.hardware import ClusterSpec, GiB, cluster_preset
from labkit.plan.layout import Layout, stage_layers
from labkit.plan.memory import rank_memory
from labkit.plan.models import PlanModel, plan_model
from labkit.plan.runtime import ADAM_BYTES_PER_PARAM, MEMORY_EFFICIENCY, Runtime, runtime_preset
from labkit.plan.steptime import AxisTime, step_time

__all__ = ["Term", "Plan", "estimate", "MEMORY_CATEGORIES", "AxisTime"]

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "comm_buffers")
_KOR = "Korthikanti et al. 2022 §4"


@dataclass(frozen=True)
class Term:
    """One number of a plan: ``value`` in ``unit``, how it is computed, where from."""

    name: str
    value: float
    unit: str
    formula: str
    source: str


@dataclass(frozen=True)
class Plan:
    """The estimate of one layout (see :func:`estimate`); bytes, seconds, fractions.

    Attributes:
        memory: :data:`MEMORY_CATEGORIES` and ``"total"`` of the fullest pipeline rank
            ``memory_rank``; ``memory_limit`` the bytes allowed.
        comm: one :class:`~labkit.plan.steptime.AxisTime` per axis ``tp, cp, pp, dp``.
        bubble: fraction of the pipeline time spent in the bubble.
        step_time: seconds per optimizer step; ``nan`` when not computed.
        mfu, hfu: model / hardware FLOP utilisation.
        terms: every number by name, with formula and source.
        reasons: why the layout fails (empty when it fits).
        rank_params: parameters one GPU of each pipeline rank holds before ZeRO sharding
            (its tp slice, its ``E/ep`` experts).
        stage_memory: ``memory``'s dict for every pipeline rank.
    """

    model: PlanModel
    cluster: ClusterSpec
    layout: Layout
    runtime: Runtime
    memory: dict
    memory_rank: int
    memory_limit: float
    comm: dict
    bubble: float
    step_time: float
    mfu: float
    hfu: float
    terms: dict = field(repr=False)
    reasons: tuple = ()
    rank_params: tuple = ()
    stage_memory: tuple = field(default=(), repr=False)

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s each GPU achieves (MFU × peak)."""
        return self.mfu * self.cluster.gpu.peak_flops / 1e12

    def summary(self) -> dict:
        """A JSON-ready dict of the whole plan."""
        lay = asdict(self.layout)
        lay["order"] = list(self.layout.order)
        lay["seq_len"] = self.model.seq_len
        return {"model": self.model.name, "cluster": self.cluster.name,
                "runtime": self.runtime.name, "layout": lay, "n_gpus": self.layout.n_gpus,
                "fits": self.fits, "reasons": list(self.reasons), "memory": dict(self.memory),
                "memory_rank": self.memory_rank, "memory_limit": self.memory_limit,
                "comm": {k: asdict(v) for k, v in self.comm.items()},
                "bubble": self.bubble, "step_time": self.step_time, "mfu": self.mfu,
                "hfu": self.hfu, "tflops_per_gpu": self.tflops_per_gpu,
                "terms": {k: asdict(v) for k, v in self.terms.items()}}


def _local_params(model: PlanModel, layout: Layout, layers: list[int]) -> tuple[list, float]:
    """Parameters of each pipeline rank on one TP rank, and of one layer.

    Attention (and a dense MLP) is split over ``tp``; norms are whole; a router and the
    experts stay whole on every tp rank (labkit's tensor parallelism) and the experts are
    split over ``ep``."""
    t, h = layout.tp, model.d_model
    norms = 2 * (h if model.norm == "rmsnorm" else 2 * h)
    moe = model.router_params + model.layer_expert_params
    per_layer = ((model.layer_params - norms - moe) / t + norms + model.router_params
                 + model.layer_expert_params / layout.ep)
    emb = model.vocab_size * h / t + (model.seq_len * h if model.learned_positions else 0)
    head = model.vocab_size * h / t if (not model.tie_embeddings or layout.pp > 1) else 0
    out = [n * per_layer for n in layers]
    out[0] += emb
    out[-1] += head + h
    return out, per_layer


def _buffers(model: PlanModel, layout: Layout, runtime: Runtime, per_layer: float) -> float:
    s, t, b = model.seq_len, layout.tp, layout.microbatch
    T = b * s // layout.cp
    out = 0.0
    if layout.zero == 3:  # the gathered unit, the prefetched next one, its full gradient
        out += 2 * 2 * per_layer + runtime.grad_bytes * per_layer
    if layout.sp:
        out += 2 * T * model.d_model
    if layout.cp > 1:
        out += 2 * 2 * b * s * max(model.kv_dim / t, model.head_dim)
    if layout.pp > 1:
        out += 2 * 2 * T * model.d_model / (t if (layout.sp or runtime.pp_scatter_gather) else 1)
    return out


def estimate(model: Union[str, PlanModel], cluster: Union[str, ClusterSpec], layout: Layout,
             runtime: Union[str, Runtime] = "llama3-2024",
             memory_limit: Optional[float] = None, timing: bool = True,
             detail: bool = True) -> Plan:
    """Estimate one ``layout`` of ``model`` on ``cluster`` under ``runtime``.

    Args:
        model: preset name, ``ModelConfig`` or :class:`PlanModel`; ``layout.seq_len``
            overrides its sequence length.
        cluster: preset name or :class:`ClusterSpec`.
        layout: the degrees and knobs.
        runtime: what the implementation overlaps (:mod:`labkit.plan.runtime`).
        memory_limit: bytes per GPU; the GPU's HBM when ``None``.
        timing: also compute the step time (``False`` leaves it ``nan``: a memory check).
        detail: build ``terms`` (``False`` is faster, for searches).

    Returns:
        a :class:`Plan`; ``plan.fits`` is False (with ``plan.reasons``) when it needs more
        memory than ``memory_limit``.

    Raises:
        ValueError: a layout the model cannot run (naming the field and the numbers), a
            layout needing more GPUs than the cluster has, unknown presets.
    """
    m = plan_model(model, layout.seq_len)
    c, r = cluster_preset(cluster), runtime_preset(runtime)
    layout.check(m)
    if layout.dp_shard is not None and layout.dp_shard % layout.cp:
        raise ValueError(f"dp_shard={layout.dp_shard} must be a multiple of cp={layout.cp}")
    if layout.n_gpus > c.n_gpus:
        raise ValueError(f"tp x cp x pp x dp = {layout.tp} x {layout.cp} x {layout.pp} x "
                         f"{layout.dp} = {layout.n_gpus} GPUs; {c.name} has {c.n_gpus}")
    gpu, p, z = c.gpu, layout.pp, layout.zero
    layers = stage_layers(m.n_layers, p)
    params, per_layer = _local_params(m, layout, layers)
    act = activation_bytes_per_rank(m, layout, layers)
    buf = _buffers(m, layout, r, per_layer)
    shard = layout.shard_group if z == 3 else layout.dp * layout.cp
    # with ep > 1 the experts of a rank are held by dp·cp/ep ranks (the expert-data group)
    experts = expert_params(m, layout, layers) if layout.ep > 1 else [0.0] * p
    edp = layout.dp * layout.cp // layout.ep if r.zero_shards_experts else 1
    ranks = [rank_memory(params[i], z, shard, r.grad_bytes, act["per_rank"][i], buf,
                         r.param_bytes, r.optimizer_bytes, experts[i], edp)
             for i in range(p)]
    mem_rank = max(range(p), key=lambda i: ranks[i]["total"])
    memory = ranks[mem_rank]
    limit = gpu.memory_bytes if memory_limit is None else float(memory_limit)
    reasons = ()
    if memory["total"] > limit:
        top = max(MEMORY_CATEGORIES, key=lambda k: memory[k])
        reasons = (f"memory {memory['total'] / GiB:.1f} GiB > limit {limit / GiB:.1f} GiB on "
                   f"pipeline rank {mem_rank} (largest: {top} {memory[top] / GiB:.1f} GiB)",)
    nan = float("nan")
    st = step_time(m, c, layout, r, layers, params) if timing else None
    if st is not None:
        tokens = layout.global_batch * m.seq_len
        model_flops = tokens * m.flops_per_token()
        hw_flops = model_flops + tokens * st.recompute_flops_per_token
        denom = st.step * layout.n_gpus * gpu.peak_flops
        mfu, hfu, step, bubble, comm = model_flops / denom, hw_flops / denom, st.step, \
            st.bubble, st.axes
    else:
        mfu = hfu = step = bubble = nan
        comm = {}
    terms = _terms(m, c, layout, r, params, memory, mem_rank, limit, act, buf, st, mfu, hfu) \
        if detail else {}
    if detail and m.moe:
        terms.update(expert_terms(m, layout, r, layers, mem_rank, Term))
    return Plan(m, c, layout, r, memory, mem_rank, limit, comm, bubble, step, mfu, hfu, terms,
                reasons, tuple(params), tuple(ranks))


def _terms(m, c, layout, r, params, memory, mem_rank, limit, act, buf, st, mfu, hfu) -> dict:
    out: dict[str, Term] = {}

    def term(name, value, unit, formula, source=""):
        out[name] = Term(name, float(value), unit, formula, source)

    z, p, gpu = layout.zero, layout.pp, c.gpu
    term("seq_per_cp_rank", m.seq_len // layout.cp, "tokens", "s / cp",
         "context parallelism shards the sequence (claim C29)")
    term("microbatches", layout.microbatches, "", "m = B / (dp · b)",
         "the batch is shared by DP and microbatches (claim C38)")
    term("params_per_gpu", params[mem_rank], "params",
         "layers_i · N_layer / tp (+ embedding / head on the first / last rank)",
         "Shoeybi et al. 2019 (Megatron) partition of weights")
    ex = " (experts: / edp when ep > 1)" if layout.ep > 1 and r.zero_shards_experts else (
        " (experts with ep > 1: whole)" if layout.ep > 1 else "")
    term("memory.parameters", memory["parameters"], "bytes",
         f"{r.param_bytes}·P" + (" / shard" + ex) * (z == 3),
         f"{r.param_bytes * 8}-bit weights; ZeRO §5.1 (Rajbhandari et al. 2020)")
    term("memory.gradients", memory["gradients"], "bytes",
         f"{r.grad_bytes}·P" + (" / shard" + ex) * (z >= 2), r.source)
    term("memory.optimizer", memory["optimizer"], "bytes",
         f"{r.optimizer_bytes}·P" + (" / shard" + ex) * (z >= 1),
         ("fp32 master + Adam m, v (ZeRO §5.1, K = 12)" if r.optimizer_bytes == 12 else
          "Adam m, v over fp32 weights") + "; not counted: torch's Adam keeps a 4-byte step "
         "count per parameter tensor (per flat unit under ZeRO)")
    term("memory.activations", memory["activations"], "bytes",
         "kept_per_layer · layers_i · in_flight_i (+ one rebuilt layer under full "
         "recomputation, + fp32 logits 4·T·V/t on the last rank)", _KOR)
    term("memory.comm_buffers", buf, "bytes", "FSDP unit ×2 + its gradient; SP all-gather "
         "2·T·h; CP K,V 2·2·b·s·kv/t; PP send + receive", "buffers collectives run in")
    term("memory.total", memory["total"], "bytes", "sum of the categories")
    term("memory.limit", limit, "bytes", "GPU HBM", gpu.source)
    term("act.layer_no_recompute", act["layer"]["total"], "bytes",
         "replicated (4Th norms, 2Th + 2Th inputs, 2Th masks) + split/t + scores", _KOR)
    term("act.kept_per_layer", act["per_layer_kept"], "bytes",
         {"none": "all of it", "selective": "all but the attention scores",
          "full": "the layer input 2Th (/t with SP)"}[layout.checkpoint], _KOR)
    term("act.in_flight_first_rank", act["in_flight"][0], "microbatches",
         {"gpipe": "m", "1f1b": "min(p, m)", "interleaved": "min(mV, 2(p−1)+(V−1)p+1)/V"}[
             layout.schedule] if p > 1 else "1",
         "Narayanan et al. 2021 §2.2; Korthikanti et al. 2022 §4.2.3")
    if st is None:
        return out
    term("t.layer_forward", st.t_f, "s", "Σ max(FLOPs/(η_mm·peak), bytes/(η_mem·HBM))",
         f"roofline (Williams et al. 2009); η_mm = {gpu.matmul_efficiency}, η_mem = "
         f"{MEMORY_EFFICIENCY}")
    term("t.layer_backward", st.t_b, "s", "2 × forward (2.5 × for flash attention)",
         "Kaplan et al. 2020 §2.1; Dao et al. 2022")
    term("t.layer_recompute", st.t_rc, "s", {"none": "0", "selective": "attention core "
                                             "forward", "full": "layer forward"}[
        layout.checkpoint], "Korthikanti et al. 2022 §5")
    term("t.stage_microbatch", st.t_mb, "s",
         "layers_i·(t_f + t_b + t_rc + exposed TP + CP) + head + exposed PP",
         f"the slowest pipeline rank ({st.slow}) sets the pace")
    term("bubble_ratio", (p - 1) / (layout.virtual_stages * layout.microbatches), "",
         "(p − 1) / (V·m)", "Narayanan et al. 2021 §2.2 (claim C31)")
    term("t.pipeline", st.t_pipe, "s", "(m + (p−1)/V) · t_microbatch",
         "Narayanan et al. 2021 §2.2.1–2.2.2")
    for a, ax in st.axes.items():
        term(f"comm.{a}.seconds", ax.seconds, "s", ax.desc,
             f"ring bytes (labkit.plan.comm) on the {ax.level} level")
        term(f"comm.{a}.exposed", ax.exposed, "s", "max(0, t − overlap · compute window)",
             r.source)
    term("t.optimizer", st.t_opt, "s", f"P_shard · {ADAM_BYTES_PER_PARAM} B / (η_mem · HBM)",
         "Adam reads and writes fp32 master, m, v; reads the gradient; writes the weights")
    term("t.step", st.step, "s", "t_pipeline + exposed DP + t_optimizer")
    term("mfu", mfu, "", "B·s · (6·(L·N_layer + h·V) + 12·L·a·d·s) / (t_step · GPUs · peak)",
         "Chowdhery et al. 2022 (PaLM) Appendix B")
    term("hfu", hfu, "", "(model + recomputed FLOPs) / (t_step · GPUs · peak)",
         "Korthikanti et al. 2022 §6")
    return out
