"""Analytic planning at cluster scale: pure functions of sizes and counts, no torch needed.

* :mod:`labkit.plan.memory` — model-state bytes per rank under DP and ZeRO-1/2/3 (C10–C12).
* :mod:`labkit.plan.comm` — bytes each rank sends in ring collectives, nccl-tests' bus
  bandwidth factor, a data-parallel step's traffic (C6, C9, C13–C15), a mixture-of-experts
  layer's all-to-all bytes under expert parallelism.
* :mod:`labkit.plan.models`, :mod:`~labkit.plan.hardware`, :mod:`~labkit.plan.runtime` —
  model shapes, clusters with their bandwidth hierarchy, and the calibration constants.
* :mod:`labkit.plan.layout` — a ``[TP, CP, PP, DP]`` layout (and ``ep``, a view over
  the ``dp·cp`` ranks for mixture-of-experts models) and its rules (C36, C38).
* :mod:`labkit.plan.experts` — a mixture-of-experts model's expert parameters per GPU
  and their terms.
* :mod:`labkit.plan.estimate` — memory by category, communication per axis, bubble, step
  time and MFU of one layout, every term with its formula and source.
* :mod:`labkit.plan.search` — the best layouts that fit, and why the others fail.
* :mod:`labkit.plan.published` — the planner against Narayanan et al. 2021 Table 1 and
  Llama 3's Table 4 (C35); :mod:`labkit.plan.rules` — the lectures' rules of thumb.
* :mod:`labkit.plan.torus` — groups on a TPU torus, rings along its axes (C41);
  :mod:`labkit.plan.regimes` — the batch-size regimes from searches over the global batch
  (C42); :mod:`labkit.plan.recent` — recent models' reported layouts, fitted and predicted
  (C43).
"""
from labkit.plan.activations import in_flight, layer_activation_bytes
from labkit.plan.comm import (COLLECTIVES, busbw_factor, comm_bytes, dp_step_comm_bytes,
                              expert_all_to_all_bytes, normalize_collective)
from labkit.plan.estimate import MEMORY_CATEGORIES, Plan, Term, estimate
from labkit.plan.hardware import CLUSTERS, GPUS, ClusterSpec, GPU, Level, cluster_preset
from labkit.plan.layout import AXES, Layout, layout_from_mesh, stage_layers
from labkit.plan.memory import (BYTES_PER_PARAM, GB, GiB, model_state_bytes, rank_memory,
                                sharded_state_bytes)
from labkit.plan.models import PLAN_MODELS, PlanModel, narayanan_flops, plan_model
from labkit.plan.runtime import RUNTIMES, Runtime, runtime_preset
from labkit.plan.search import Rejected, SearchResult, search

__all__ = ["COLLECTIVES", "busbw_factor", "comm_bytes", "dp_step_comm_bytes",
           "expert_all_to_all_bytes",
           "normalize_collective", "BYTES_PER_PARAM", "model_state_bytes", "rank_memory",
           "sharded_state_bytes", "GB", "GiB", "in_flight", "layer_activation_bytes",
           "MEMORY_CATEGORIES", "Plan", "Term", "estimate", "CLUSTERS", "GPUS",
           "ClusterSpec", "GPU", "Level", "cluster_preset", "AXES", "Layout", "layout_from_mesh",
           "stage_layers",
           "PLAN_MODELS", "PlanModel", "narayanan_flops", "plan_model", "RUNTIMES", "Runtime",
           "runtime_preset", "Rejected", "SearchResult", "search"]
