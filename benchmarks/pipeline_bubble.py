"""Measured vs simulated pipeline bubble for every schedule, P in {4, 2}, M in {4, 8}, several runs.

The measured bubble comes from the recorded F/B/W spans of a real run of the one training
job (:func:`labkit.jobs.train` on a ``RunConfig`` with ``pp=P``, read by
:func:`labkit.parallel.pipeline.bubble.measure_bubble`; step 0 and the memory-tracked last
step are left out). ``simulated`` is the schedule on
this machine: the simulator fed each stage's measured mean CPU work, the separately measured
one-way message time per hop and the executor's own CPU time per action, a processor per
rank (every term measured, none fitted to the bubble); ``gap_pp`` is measured − simulated.
Beside it: ``unit`` (the lecture's unit-cost bubble), ``dedicated`` (without the executor
term), ``cores`` (the cores the ranks got while computing) and ``shared_ms`` against
``window_ms`` (the flush time processor sharing on those cores predicts, and the measured
one; see labkit.parallel.pipeline.bubble for why sharing is not in the bubble's rung).

Per-action executor time, read from the trace: ``exec_cpu_ms`` (the executor's CPU time
between two spans of a rank: posting messages and bookkeeping) and ``gap_ms`` (the median
wall gap between two spans of a rank that did not wait for a message).

The whole sweep runs ``--runs`` times in a row (default 3) on one warm cluster per ``P``;
the table for each ``P`` gives each configuration's gaps, their spread and the load average
seen. Target: |gap_pp| <= 3 for every schedule at M in {4, 8}, in every run.

The simulation on this machine gives every rank a processor of its own (the executor and
message terms are measured; core sharing is not modelled, see
labkit.parallel.pipeline.bubble). The table says whether that holds: ``P <= cores`` (P=2
on the lab's 2 cores) is the check of the executor and the simulator; at ``P > cores``
(P=4 on 2 cores) ranks that compute at once share the cores, and the schedules that keep
most ranks busy at once (interleaved, ZB-V) measure more bubble than a processor per rank
gives. Read the load column too: other work on the machine disturbs every row.

    python benchmarks/pipeline_bubble.py [--pp 4,2 --microbatches 4,8 --runs 3]

Prints ``RESULT pipeline_bubble run=... schedule=... M=... measured=... simulated=...``
lines, then ``TABLE`` lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections import defaultdict

import torch

import labkit
from labkit import jobs
from labkit.config import RunConfig
from labkit.parallel.pipeline.bubble import _measured_spans, measure_bubble
from labkit.parallel.pipeline.machine import gaps
from labkit.parallel.pipeline.presets import PP_BALANCED
from labkit.parallel.pipeline.schedules import SCHEDULES


def one(cluster, args, mc, name: str, m: int, run: int) -> dict:
    pp = cluster.world_size
    cfg = RunConfig(model=mc, schedule=name, microbatches=m, micro_batch=args.micro_batch,
                    global_batch=m * args.micro_batch, steps=args.steps, count_flops=False,
                    timeout_s=600).replace(pp=pp)
    load = os.getloadavg()[0]
    r = cluster.run(jobs.train, cfg)
    sched = cfg.build_schedule()
    lat = r.metrics[0]["p2p_latency_s"]
    rep = measure_bubble(r.trace, sched, comm=lat)
    free, _ = gaps(_measured_spans(r.trace, 1)[0], sched)
    row = {"run": run, "P": pp, "schedule": name, "M": m, "measured": rep.bubble,
           "simulated": rep.predicted_bubble, "gap_pp": rep.gap_pp, "unit": rep.unit.bubble,
           "dedicated": rep.dedicated.bubble, "cores": rep.cores,
           "exec_cpu_ms": 1e3 * rep.executor_s, "window_ms": 1e3 * rep.window,
           "shared_ms": 1e3 * rep.shared.makespan if rep.shared else None,
           "gap_ms": 1e3 * statistics.median(free),
           "message_ms": 1e3 * lat, "load": (load + os.getloadavg()[0]) / 2,
           "inflight": [mt["peak_inflight"] for mt in r.metrics],
           "peak_act_MiB": [round(mt["peak_activation_bytes"] / 2**20, 2) for mt in r.metrics]}
    print(f"RESULT pipeline_bubble run={run} schedule={name} P={pp} M={m} "
          f"V={cfg.stages_per_rank} measured={rep.bubble:.3f} "
          f"simulated={rep.predicted_bubble:.3f} gap_pp={rep.gap_pp:+.1f} "
          f"unit={row['unit']:.3f} dedicated={row['dedicated']:.3f} "
          f"cores={'-' if rep.cores is None else f'{rep.cores:.2f}'} "
          f"window_ms={row['window_ms']:.1f} "
          f"shared_ms={'-' if rep.shared is None else f'{1e3 * rep.shared.makespan:.1f}'} "
          f"exec_cpu_ms={row['exec_cpu_ms']:.3f} gap_ms={row['gap_ms']:.3f} "
          f"message_ms={row['message_ms']:.2f} hop_ms={1e3 * rep.hop_s:.2f} "
          f"dispatch_ms={1e3 * rep.dispatch_s:.2f} replayed={rep.replayed_bubble:.3f} "
          f"load={row['load']:.2f} inflight={row['inflight']} "
          f"peak_act_MiB={row['peak_act_MiB']}", flush=True)
    return row


def table(rows: list, cores: int) -> None:
    """One table per P: gaps per configuration over the runs, then the verdict."""
    by = defaultdict(list)
    for r in rows:
        by[(r["schedule"], r["M"])].append(r)
    p = rows[0]["P"]
    share = ("a core per rank" if p <= cores else
             f"{p} ranks share {cores} cores: the simulation's processor per rank does not hold")
    print(f"TABLE P={p} on {cores} cores ({share})")
    print("TABLE schedule     M  measured%             simulated%            gap pp"
          "                spread  max|gap|  unit%  cores  exec ms  load")
    for (name, m), rs in by.items():
        f = lambda k: " ".join(f"{100 * r[k]:5.1f}" for r in rs)  # noqa: E731
        gaps = [r["gap_pp"] for r in rs]
        cores = [r["cores"] for r in rs if r["cores"] is not None]
        loads = "/".join(f"{r['load']:.1f}" for r in rs)
        print(f"TABLE {name:11s} {m:2d}  {f('measured'):20s}  {f('simulated'):20s}  "
              f"{' '.join(f'{g:+5.1f}' for g in gaps):20s}  {max(gaps) - min(gaps):6.1f}  "
              f"{max(abs(g) for g in gaps):8.1f}  {100 * rs[0]['unit']:5.1f}  "
              f"{statistics.mean(cores) if cores else float('nan'):5.2f}  "
              f"{statistics.mean(r['exec_cpu_ms'] for r in rs):7.3f}  "
              f"{loads}")
    ok = all(abs(r["gap_pp"]) <= 3.0 for r in rows)
    print(f"TABLE P={p}: every |gap| <= 3 pp in every run: {ok}")


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", default="4,2", help="pipeline sizes, comma-separated")
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=PP_BALANCED.n_layers)
    ap.add_argument("--d-model", type=int, default=PP_BALANCED.d_model)
    ap.add_argument("--seq", type=int, default=PP_BALANCED.seq_len)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    mc = dataclasses.replace(PP_BALANCED, n_layers=args.layers, d_model=args.d_model,
                             seq_len=args.seq)
    cores = len(os.sched_getaffinity(0))
    rows, tables = [], []
    for pp in [int(v) for v in args.pp.split(",")]:
        mine = []
        with labkit.Cluster(pp, backend="gloo", device="cpu") as cluster:
            for run in range(args.runs):
                for m in [int(v) for v in args.microbatches.split(",")]:
                    for name in args.schedules.split(","):
                        mine.append(one(cluster, args, mc, name, m, run))
        rows += mine
        tables.append(mine)
    for mine in tables:
        table(mine, cores)
    return rows


if __name__ == "__main__":
    main()
