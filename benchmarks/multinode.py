"""Emulated nodes (issue 27): the links, the lectures' layout experiments, and the cost.

Two 4-rank clusters of 2 emulated nodes (``labkit.nodes``): "block" (ranks 0,1 | 2,3: the
mesh's order, tp innermost) and "cyclic" (0,2 | 1,3: tp outermost). Prints

1. the links: all-reduce busbw of a pair inside a node and across, the configured rate,
   the inside/across ratio (claim C2: NVLink/IB per GPU = 900/50 = 18) and the
   emulated-vs-configured error;
2. each experiment of ``labkit.measure.hierarchy.EXPERIMENTS`` in both layouts (``--runs``
   interleaved runs, medians): step time,
   bytes per step on each node's link (tc counters) and per mesh axis (labkit.comm), the
   planner's predicted step on the measured links (following the job's overlap and pipeline
   schedule, ``labkit.measure.step_model``, each crossing call with the share of its node's
   link the run shows) and its error, the worst case (every rank of a node crossing at
   once), the flat sum of compute and every call (nothing overlapped, no bubble) and
   communication time, and the lecture's statement;
3. the cost: an all-compute job (matmuls, no communication) on a flat cluster and on the
   emulated one, and the emulation's code path when off (``nodes=1`` spawns ranks exactly
   as before: no namespace, no tc).

    RESULT inside_across_ratio <x>
    RESULT link_error_pct <measured across / configured - 1, %>
    RESULT <experiment>_<variant>_step_ms / _pred_ms / _worst_ms / _flat_ms
    RESULT planner_abs_error_median_pct / _max_pct  (|planner / measured - 1| over variants)
    RESULT planner_direction_agrees <k>/4  (pairs whose faster layout the planner names)
    RESULT compute_slowdown_pct <emulated / flat - 1, %>  (runs interleaved, median)

Timings of rank processes sharing the machine's cores: run it on an otherwise idle machine
(the load average is printed first). ``--inter-node`` sets the link (default
``labkit.nodes.DEFAULT_INTER_NODE``), ``--model``/``--steps`` the training job.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import labkit as lk  # noqa: E402
from labkit.config import RunConfig  # noqa: E402
from labkit.measure.hierarchy import (EXPERIMENTS, measure_cluster_links, run_variant,  # noqa: E402
                                     warm_up)
from labkit.nodes import DEFAULT_INTER_NODE, probe  # noqa: E402


def _cfg(model: str, steps: int, changes: tuple) -> RunConfig:
    return RunConfig(model=model, steps=steps).replace(**dict(changes))


def _compute(cluster) -> tuple:
    """The slowest rank's ``(wall s, CPU s)`` for the all-compute job, on as many ranks as
    the machine has cores (more would time the scheduler, not the compute)."""
    from benchjobs import matmul_burn

    out = cluster.run(matmul_burn, 40, nranks=min(cluster.world_size, os.cpu_count() or 1)
                      ).outputs
    return max(w for w, _ in out), max(c for _, c in out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inter-node", default=DEFAULT_INTER_NODE)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="all-compute job repeats")
    p.add_argument("--compute-only", action="store_true",
                   help="only the all-compute job, flat vs emulated (section 3)")
    p.add_argument("--runs", type=int, default=3,
                   help="interleaved runs of each layout (the table shows medians)")
    a = p.parse_args(argv)
    print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} cores", flush=True)
    reason = probe()
    if reason:
        print(f"cannot emulate nodes here: {reason}")
        return 1
    clusters, links = {}, None
    if a.compute_only:
        return _cost(lk.Cluster(4, nodes=2, inter_node=a.inter_node, replace=False), a.reps)
    for placement in ("block", "cyclic"):
        t0 = time.perf_counter()
        c = lk.Cluster(4, nodes=2, inter_node=a.inter_node, placement=placement,
                       replace=False)
        c.run(lk.jobs.hello)
        warm_up(c, a.model)
        print(f"{placement}: {c!r} started in {time.perf_counter() - t0:.1f} s", flush=True)
        clusters[placement] = c
    links = measure_cluster_links(clusters["block"])
    print(f"\nlinks: inside a node {links.inside_bw / 1e6:,.1f} MB/s busbw, "
          f"across {links.across_bw / 1e6:,.1f} MB/s (configured "
          f"{links.configured / 1e6:,.1f} MB/s per direction); hop "
          f"{links.inside_hop_s * 1e6:,.0f} us inside, {links.across_hop_s * 1e6:,.0f}"
          f" us across")
    print(f"RESULT inside_across_ratio {links.ratio:.2f}   (lecture, per GPU: "
          f"NVLink 900 / IB 50 = 18)")
    print(f"RESULT link_error_pct {100 * links.link_error:+.1f}", flush=True)
    # each pair A B, then B A, … so drift in the machine's load hits both layouts alike
    runs: dict = {}
    for i in range(a.runs):
        for ex in EXPERIMENTS:
            for v in ((ex.a, ex.b) if i % 2 == 0 else (ex.b, ex.a)):
                cfg = _cfg(a.model, a.steps, v.changes)
                runs.setdefault((ex.name, v.label), []).append(
                    run_variant(clusters[v.placement], cfg, links))
        print(f"  round {i + 1}/{a.runs} done", flush=True)
    results = {k: {f: (statistics.median(r[f] for r in rs)
                       if f in ("step_s", "comm_s", "pred_comm_s", "pred_step_s", "pred_worst_s",
                                "pred_flat_s")
                       else rs[0][f])
                   for f in rs[0]} for k, rs in runs.items()}
    print(f"\n{'experiment / variant':52} {'step ms':>8} {'planner':>8} {'error':>6} {'worst':>8} {'flat':>8} "
          f"{'bubble':>6} {'comm ms':>8} {'planner':>8} {'MB/step across':>15}  "
          f"bytes/step per axis (rank 0)")
    errors, agree = [], 0
    for ex in EXPERIMENTS:
        print(f"{ex.name}  [{ex.claim}: {ex.lecture}]")
        steps = {}
        for v in (ex.a, ex.b):
            r = results[(ex.name, v.label)]
            steps[v.label] = r
            across = sum(r["link_bytes_per_step"].values()) / 1e6
            axes = ", ".join(f"{ax} {sum(d.values()) / 1e6:.2f} MB"
                             for ax, d in r["axis_bytes"].items())
            err = r['pred_step_s'] / r['step_s'] - 1
            errors.append(abs(err))
            print(f"  {v.label:50} {r['step_s'] * 1e3:8.1f} {r['pred_step_s'] * 1e3:8.1f} "
                  f"{100 * err:+5.0f}% {r['pred_worst_s'] * 1e3:8.1f} "
                  f"{r['pred_flat_s'] * 1e3:8.1f} {r['pred_bubble']:6.0%} "
                  f"{r['comm_s'] * 1e3:8.1f} {r['pred_comm_s'] * 1e3:8.1f} {across:15.3f}  {axes}")
            key = f"{ex.claim}_{v.label.replace(' ', '_')}"
            print(f"RESULT {key}_step_ms {r['step_s'] * 1e3:.1f}")
            print(f"RESULT {key}_pred_ms {r['pred_step_s'] * 1e3:.1f}")
            print(f"RESULT {key}_worst_ms {r['pred_worst_s'] * 1e3:.1f}")
            print(f"RESULT {key}_flat_ms {r['pred_flat_s'] * 1e3:.1f}")
        ra, rb = steps[ex.a.label], steps[ex.b.label]
        dl = max(abs(x - y) for x, y in zip(ra["losses"], rb["losses"]))
        print(f"  -> {ex.b.label} / {ex.a.label}: step time measured "
              f"{rb['step_s'] / ra['step_s']:.2f}x, planner "
              f"{rb['pred_step_s'] / ra['pred_step_s']:.2f}x (throughput "
              f"{100 * (ra['step_s'] / rb['step_s'] - 1):+.0f} % measured, "
              f"{100 * (ra['pred_step_s'] / rb['pred_step_s'] - 1):+.0f} % planner); bytes "
              f"across {sum(rb['link_bytes_per_step'].values()) / 1e6:.2f} vs "
              f"{sum(ra['link_bytes_per_step'].values()) / 1e6:.2f} MB/step; largest loss "
              f"difference {dl:.1e}")
        agree += (rb["step_s"] > ra["step_s"]) == (rb["pred_step_s"] > ra["pred_step_s"])
    print(f"RESULT planner_abs_error_median_pct {100 * statistics.median(errors):.1f}")
    print(f"RESULT planner_abs_error_max_pct {100 * max(errors):.1f}")
    print(f"RESULT planner_direction_agrees {agree}/{len(EXPERIMENTS)}")
    clusters.pop("cyclic").close()
    return _cost(clusters.pop("block"), a.reps)


def _cost(emulated_cluster, reps: int) -> int:
    """Section 3: the all-compute job on the emulated cluster and on a flat one, runs
    interleaved; wall and CPU time (the slowest rank's), medians."""
    emulated_cluster.run(lk.jobs.hello)
    with lk.Cluster(4, replace=False) as flat:
        flat.run(lk.jobs.hello)
        pairs = [(_compute(emulated_cluster), _compute(flat)) for _ in range(reps)]
    emulated_cluster.close()
    med = lambda i, j: statistics.median(p[i][j] for p in pairs)  # noqa: E731
    print(f"\nall-compute job (40 matmuls 256x256 per rank, a core per rank, no "
          f"communication), median of "
          f"{reps} interleaved pairs: wall flat {med(1, 0) * 1e3:.1f} ms, emulated "
          f"{med(0, 0) * 1e3:.1f} ms; CPU flat {med(1, 1) * 1e3:.1f} ms, emulated "
          f"{med(0, 1) * 1e3:.1f} ms")
    print(f"RESULT compute_slowdown_pct {100 * (med(0, 0) / med(1, 0) - 1):+.1f}  (wall)")
    print(f"RESULT compute_cpu_slowdown_pct {100 * (med(0, 1) / med(1, 1) - 1):+.1f}  (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
