"""Detection and recovery times of injected faults on a warm 2-rank cluster, and goodput.

For each fault — a rank SIGKILLed at step 3, a rank stalled at its first collective of
step 3 (before it enters), a rank frozen inside it (``stall``: every member entered, a
stall inside the backend), a rank that skips an all-reduce at step 3 (the three with
``watchdog_s``), a straggler (watched live with ``straggler_s=0.1``) —
:func:`labkit.faults.recover.run_resilient` runs the training job (dp=2, tiny model) through
it and reports

* detect: seconds from the injected fault (stamped in the rank's flight record) to the
  cluster noticing it; the stated bounds are ≤ poll (0.5 s) + 1 s for a kill and
  ≤ ``watchdog_s`` + poll for a hang; for the straggler, the live report: from its first
  delayed step to the cluster naming it, split into the wait for its third late step (the
  rule) and the poll (stated bound 0.25 s);
* recovery: detection → the restarted pool ready (spawn, import torch, join the group);
* lost work: the steps since the last snapshot × step time (from step 0 without one;
  "kill+resume" saves every 2 steps and resumes from the last, labkit.snapshot);
* goodput: kept work / wall time of the whole faulted run, beside the clean run's.

Then the planner (labkit.faults.goodput): expected goodput against the checkpoint interval
for the measured restart time, and Llama 3's 54-day figures (C39).
Usage: python benchmarks/fault_recovery.py [--reps N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FAULTS = {"kill": "kill@3:rank1", "kill+resume": "kill@3:rank1", "hang": "hang@3:rank1",
          "stall": "stall@3:rank1", "skip": "skip@3:rank1", "slow": "slow@1:rank1:seconds=0.2"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--watchdog", type=float, default=2.0)
    ap.add_argument("--only", default=",".join(FAULTS), help="faults to run, comma-separated")
    args = ap.parse_args()

    from labkit import Cluster, jobs
    from labkit.config import RunConfig
    from labkit.faults.goodput import expected_goodput, llama3_example, young_interval
    from labkit.faults.recover import run_resilient
    from labkit.faults.straggler import stragglers

    base = RunConfig(parallel=dict(dp=2), steps=6, global_batch=4, measure_memory=False,
                     count_flops=False, timeout_s=120)
    rows = {k: [] for k in FAULTS if k in args.only.split(",")}
    live: list = []
    with Cluster(2, replace=False) as c:
        c.run(jobs.train, base)  # warm
        t0 = time.perf_counter()
        clean = c.run(jobs.train, base)
        clean_wall = time.perf_counter() - t0
        clean_good = base.steps * clean.metrics[0]["step_time_s"] / clean_wall
        for _ in range(args.reps):
            for kind, spec in ((k, FAULTS[k]) for k in rows):
                cfg = base.replace(fault=spec)
                if kind in ("hang", "skip", "stall"):
                    cfg = cfg.replace(watchdog_s=args.watchdog)
                if kind == "slow":
                    cfg = cfg.replace(straggler_s=0.1)
                if kind == "kill+resume":  # snapshots every 2 steps: resume after step 2
                    cfg = cfg.replace(save_dir=tempfile.mkdtemp(prefix="labkit-bench-"),
                                      save_every=2)
                t0 = time.perf_counter()
                said: list = []
                run = run_resilient(c, cfg, resume=kind == "kill+resume",
                                    on_fault=lambda cost, exc: said.append(str(exc)))
                wall = time.perf_counter() - t0
                first = run.result.metrics[0].get("first_step", 0)
                assert run.result.losses == clean.losses[first:], kind  # the same run
                cost = run.faults[0] if run.faults else None
                what = str(stragglers(run.result.trace, 0.1, 1))
                for ev in run.result.faults:  # the live report, while the job ran
                    s = ev.extra["straggler"]
                    live.append((ev.detect_s, s.t_seen - ev.injected_at,
                                 ev.detected_at - s.t_seen))
                    what = f"live after {ev.detect_s:.2f} s: {ev.message}"
                if kind in ("stall", "hang", "skip") and said:
                    what = said[0]
                rows[kind].append((cost, wall, run.goodput, what))
                c.run(jobs.train, base)  # re-warm the ranks (a fresh pool builds caches)
    print(f"clean run: {base.steps} steps, wall {clean_wall:.2f} s, goodput {clean_good:.2f}")
    print(f"{'fault':>11} {'detect s':>9} {'recovery s':>11} {'lost s':>7} {'wall s':>7} "
          f"{'goodput':>8}  what")
    for kind, rs in rows.items():
        for cost, wall, good, strag in rs:
            if cost is None:
                print(f"{kind:>11} {'—':>9} {'—':>11} {'—':>7} {wall:>7.2f} {good:>8.2f}  {strag}")
            else:
                det = "—" if cost.detect_s is None else f"{cost.detect_s:.2f}"
                print(f"{kind:>11} {det:>9} {cost.recovery_s:>11.2f} "
                      f"{cost.lost_s:>7.2f} {wall:>7.2f} {good:>8.2f}  {cost.kind} rank "
                      f"{cost.rank} step {cost.step}")
    for kind in [k for k in ("hang", "stall", "skip") if rows.get(k)]:
        print(f"\n{kind}: what the cluster said\n{rows[kind][-1][3]}")
    if live:
        print(f"straggler named live: {statistics.median(d for d, _, _ in live):.2f} s after its "
              f"first slow step (waiting for the 3rd late step "
              f"{statistics.median(w for _, w, _ in live):.2f} s + the poll "
              f"{statistics.median(p for _, _, p in live):.2f} s; bound 0.25 s)")
        print(f"RESULT fault_straggler_live_detect_s {statistics.median(d for d, _, _ in live):.3f}")
        print(f"RESULT fault_straggler_live_poll_s {statistics.median(p for _, _, p in live):.3f}")
    for kind in [k for k in ("kill", "kill+resume", "hang", "stall", "skip") if k in rows]:
        det = [r[0].detect_s for r in rows[kind] if r[0] is not None and r[0].detect_s is not None]
        rec = [r[0].recovery_s for r in rows[kind] if r[0] is not None]
        if det and rec:
            kind = kind.replace("+", "_")
            print(f"RESULT fault_{kind}_detect_s {statistics.median(det):.3f}")
            print(f"RESULT fault_{kind}_recovery_s {statistics.median(rec):.3f}")
    restart = statistics.median([r[0].recovery_s for k in ("kill", "hang", "stall", "skip")
                                 for r in rows.get(k, []) if r[0] is not None] or [10.0])
    print(f"\nplanner: expected goodput vs checkpoint interval, checkpoint 30 s, restart "
          f"{restart:.1f} s (measured), MTBF 1 hour")
    for tau in (60, 300, young_interval(30, 3600), 1800, 3600):
        print(f"  every {tau:7.0f} s: {expected_goodput(tau, 30, 3600, restart):.3f}")
    ex = llama3_example()
    print(f"Llama 3 (54 days, 419 unplanned interruptions): MTBF {ex['mtbf_s'] / 3600:.2f} h, "
          f"Young interval {ex['young_s'] / 60:.1f} min for a 60 s checkpoint; goodput "
          f"{ex['goodput_at_optimum']:.3f} there vs {ex['goodput_hourly']:.3f} hourly "
          "(10 min restarts)")


if __name__ == "__main__":
    main()
