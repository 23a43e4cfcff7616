"""One composition run on the cluster, checked against the oracle: every rank's losses,
first-step gradients (before the optimizer) and final parameters, the MoE routing counts
and aux loss, and the FLOPs each data replica's ranks report; and every prediction shown
beside a measurement: bytes per axis and collective, model state per rank (the job's
prediction, and the planner's or the job's words for why it differs).

:func:`disagreements` returns readable lines, empty when everything agrees, so the CI test
and the sweep (``benchmarks/matrix_sweep.py``) judge alike.

Tolerances. fp32: ``1e-5`` absolute on losses, gradients and parameters (the two sides sum
the same terms in different orders). bf16 runs are held against the fp32 oracle by a
measured yardstick: the oracle itself under bf16 autocast. Each gradient's relative error
``‖g − g_ref‖ / ‖g_ref‖`` may be up to ``2×`` the oracle's own bf16 error for that tensor
(with ZeRO ≥ 1, whose flat units hold bf16 weights, the larger of that and the oracle's
error with bf16-rounded weights)
plus ``BF16_FLOOR`` (measured: under 1 % for dense weights, up to 22 % for routers and
experts, where bf16 flips near-ties of the top-k), the losses ``4×`` the oracle's own
difference plus ``1e-3``, and parameters ``2·lr·steps``: AdamW moves a weight by about
``lr`` per step whatever its gradient's scale, so after the optimizer that is all a bf16
run can be held to; its gradients carry the real check.
"""
from __future__ import annotations

import re

import torch

from .run import reference_flops, reference_run
from .vit import vit_reference_flops, vit_reference_run

__all__ = ["disagreements", "oracle_for", "TOL", "BF16_FLOOR"]

TOL = 1e-5
BF16_FLOOR = 0.02
_CACHE: dict = {}


def oracle_for(cfg, bf16: bool = False, bf16_weights: bool = False) -> dict:
    """:func:`reference_run` of ``cfg`` (``bf16``: under autocast; ``bf16_weights``: with
    bf16-rounded weights too), cached on what it depends on; for a ViT
    (``kind="vit"``), :func:`oracle.vit.vit_reference_run` alike."""
    mc = cfg.model_config
    key = (mc, cfg.global_batch, cfg.steps, cfg.seed, cfg.lr, cfg.weight_decay, cfg.adam_eps)
    if mc.n_experts:  # the token groups
        key += (cfg.parallel.dp, cfg.micro, cfg.parallel.cp, cfg.parallel.cp > 1 and cfg.cp_zigzag)
    key += (bf16, bf16_weights)
    if key not in _CACHE:
        run = vit_reference_run if mc.kind == "vit" else reference_run
        _CACHE[key] = run(cfg, bf16=bf16, bf16_weights=bf16_weights)
    return _CACHE[key]


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def _replica(coords: dict, cfg) -> int:
    """A rank's data-parallel index: ``dp_replicate × (dp / replicas) + dp_shard``."""
    shards = cfg.parallel.dp // cfg.mesh.dp_replicate
    return coords.get("dp_replicate", 0) * shards + coords.get("dp_shard", 0)


def _layers_held(state: dict) -> list:
    return sorted({int(m.group(1)) for n in state
                   if (m := re.match(r"layers\.(\d+)\.mlp\.router\.", n))})


def disagreements(result, cfg) -> list:
    """Every way ``result`` (``cluster.run(jobs.train, cfg)`` with ``return_grads`` and
    ``return_state``) differs from the oracle, one line each; ``[]`` when it agrees."""
    ref, bad = oracle_for(cfg), []
    bf16 = cfg.precision == "bf16"
    loss_tol = TOL
    if bf16:
        own = oracle_for(cfg, bf16=True)
        # ZeRO >= 1 holds the weights themselves in bf16: the yardstick is the larger of the
        # two regimes' own errors (a capacity's drops flip on the rounded router)
        owns = [own] + ([oracle_for(cfg, bf16=True, bf16_weights=True)]
                        if cfg.zero_stage >= 1 else [])
        loss_tol = 1e-3 + 4 * max(abs(a - b) for o in owns
                                  for a, b in zip(o["losses"], ref["losses"]))
    for r, o in enumerate(result.outputs):
        d = max(abs(a - b) for a, b in zip(o["losses"], ref["losses"]))
        if len(o["losses"]) != cfg.steps or d > loss_tol:
            bad.append(f"rank {r} losses {o['losses']} vs {ref['losses']} (|Δ| {d:.2e})")
    held = set()
    for key in ("grads", "state"):
        for r, o in enumerate(result.outputs):
            worst = (0.0, "")
            for name, t in o[key].items():
                held.add(name)
                want = ref[key][name]
                if t.shape != want.shape:
                    bad.append(f"rank {r} {key} {name} shape {tuple(t.shape)} vs "
                               f"{tuple(want.shape)}")
                    continue
                if key == "grads" and bf16:
                    err = _rel(t, want)
                    tol = BF16_FLOOR + 2 * max(_rel(o["grads"][name], want) for o in owns)
                else:
                    err = (t - want).abs().max().item()
                    tol = 2 * cfg.lr * cfg.steps if bf16 else TOL
                if err > tol and err > worst[0]:
                    worst = (err, name)
            if worst[0]:
                bad.append(f"rank {r} {key}: worst {worst[1]} {worst[0]:.2e}")
    missing = sorted(set(ref["state"]) - held)
    if missing:
        bad.append(f"no rank returned {missing}")
    if cfg.model_config.n_experts:
        bad += _routing(result, cfg, ref)
    bad += _flops(result, cfg)
    bad += _bytes(result)
    bad += _model_state(result)
    return bad


def _routing(result, cfg, ref) -> list:
    """Per step and layer: choices per expert (before and after dropping) summed over the
    data ranks of tp index 0, and the aux loss averaged over the ranks holding the layer."""
    bad = []
    for s in range(cfg.steps):
        counts, kept, aux = {}, {}, {}
        for o in result.outputs:
            rec, layers = o["routing"][s], _layers_held(o["state"])
            for i, layer in enumerate(layers):
                aux.setdefault(layer, []).append(rec["aux"][i])
                if o["metrics"]["coords"].get("tp", 0) == 0:
                    for acc, got in ((counts, rec["counts"][i]), (kept, rec["kept"][i])):
                        acc[layer] = [a + b for a, b in zip(acc.get(layer, [0] * len(got)), got)]
        for layer in sorted(aux):
            mean = sum(aux[layer]) / len(aux[layer])
            if abs(mean - ref["aux"][s][layer]) > (1e-2 if cfg.precision == "bf16" else 1e-5):
                bad.append(f"step {s} layer {layer} aux {mean:.6f} vs {ref['aux'][s][layer]:.6f}")
            if cfg.precision == "fp32":  # bf16 rounding may flip a near-tie in the top-k
                for what, acc in (("counts", counts), ("kept", kept)):
                    if acc[layer] != ref[what][s][layer]:
                        bad.append(f"step {s} layer {layer} {what} {acc[layer]} vs "
                                   f"{ref[what][s][layer]}")
    return bad


def _flops(result, cfg) -> list:
    """Model FLOPs summed over each replica's ranks equal the oracle's count for that
    replica; hardware FLOPs exceed them by exactly the recomputed forward."""
    bad, per = [], {}
    for o in result.outputs:
        m = o["metrics"]
        d = _replica(m["coords"], cfg)
        got = per.setdefault(d, [0, 0])
        got[0] += m["flops_per_step"]
        got[1] += m["hardware_flops_per_step"]
    for d, (model, hw) in sorted(per.items()):
        want = (vit_reference_flops if cfg.model_config.kind == "vit" else reference_flops)(
            cfg, d)
        if model != want["model"]:
            bad.append(f"replica {d} flops_per_step Σ {model:.0f} vs {want['model']} "
                       f"(×{model / want['model']:.3f})")
        if hw - model != want["recompute"]:
            bad.append(f"replica {d} hardware − model flops {hw - model:.0f} vs recompute "
                       f"{want['recompute']}")
    return bad


def _bytes(result) -> list:
    """Every prediction shown beside a measurement equals it: on every rank, each axis's
    predicted bytes per collective are the bytes its traced calls moved in the timed step."""
    bad = []
    for m in result.metrics:
        for axis, ops in m["comm_predicted_by_axis"].items():
            got = {k: v for k, v in m["comm_bytes_by_axis"].get(axis, {}).items() if v}
            want = {k: v for k, v in ops.items() if v}
            if got != want:
                bad.append(f"rank {m['rank']} bytes on {axis}: measured {got}, predicted {want}")
    return bad



STATE = ("parameters", "gradients", "optimizer")


def _model_state(result) -> list:
    """On every rank whose memory was measured: the model state the tracker measured equals
    the job's prediction, category by category, exactly; and the planner's parameters and
    state for the rank (plus AdamW's step counters, which it leaves out) equal what the rank
    holds exactly when the job's ``memory_planned["note"]`` is empty — a note (words for what
    the plan does not model) is there for exactly the ranks where they differ."""
    bad = []
    for m in result.metrics:
        if not m.get("memory"):
            continue
        got, pred, plan = m["memory"]["model_state"], m["memory_predicted"], m["memory_planned"]
        if {c: got[c] for c in STATE} != {c: pred[c] for c in STATE}:
            bad.append(f"rank {m['rank']} model state measured {got}, predicted {pred}")
        held = {"rank_params": m["rank_params"], **{c: got[c] for c in STATE}}
        planned = {k: plan[k] for k in held}
        if plan["optimizer"] is not None:
            planned["optimizer"] += plan["step_counters"]
        if (planned == held) == bool(plan["note"]):
            bad.append(f"rank {m['rank']} planner {planned} vs held {held} with note "
                       f"{plan['note']!r}: a note must be there exactly when they differ")
    return bad
