"""Soak: does a warm rank stay the same size and speed over many re-runs?

Runs the tiny training job ``RUNS`` times (default 200) on one warm 4-rank cluster, cycling
through a few slider-like configurations (dp 4 / 2 / 1, a smaller micro-batch, full
checkpointing), as a user moving the explorer's sliders would. Prints, for the first, middle
and last window of runs, the median and p90 latency of ``cluster.run`` and every rank's
resident set size (RSS), then the growth from start to end.

What a job leaves behind on a rank must be bounded (per-pool group cache, FLOP counts per
shape, the calibrated peak); everything else is released after each job. Flat means: RSS
growth well under the first run's allocation, latency within the machine's noise.

    .venv/bin/python benchmarks/soak.py [--runs 200] [--window 20]

Prints ``RESULT soak_rss_growth_mib <max over ranks>`` and
``RESULT soak_latency_ratio_end_over_start <x>``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MiB = 2 ** 20


def _rss(pids) -> list:
    import psutil

    return [psutil.Process(p).memory_info().rss / MiB for p in pids]


def _p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--window", type=int, default=20)
    args = ap.parse_args(argv)
    if args.runs < 3 * args.window:
        ap.error(f"--runs {args.runs} must be at least 3 x --window {args.window}")

    import torch

    import labkit as lk

    torch.set_num_threads(1)
    base = lk.RunConfig(model="tiny", steps=3, global_batch=8)
    configs = [base.replace(dp=4), base.replace(dp=2), base.replace(dp=1),
               base.replace(dp=4, micro_batch=1), base.replace(dp=4, checkpoint="full")]
    with lk.Cluster(world_size=4, backend="gloo", device="cpu") as cluster:
        for cfg in configs:  # first use of each shape counts FLOPs, calibrates the peak
            cluster.run(lk.jobs.train, cfg)
        pids = cluster.pids
        lat, rss = [], {}
        marks = {0: "start", args.runs // 2: "middle", args.runs - args.window: "end"}
        t_all = time.perf_counter()
        for i in range(args.runs):
            if i in marks:
                rss[marks[i]] = _rss(pids)
            t0 = time.perf_counter()
            cluster.run(lk.jobs.train, configs[i % len(configs)])
            lat.append(time.perf_counter() - t0)
        rss["after"] = _rss(pids)
        assert cluster.pids == pids, "the pool restarted during the soak"
        total = time.perf_counter() - t_all

    w = args.window
    windows = {"start": lat[:w], "middle": lat[args.runs // 2:args.runs // 2 + w],
               "end": lat[-w:]}
    print(f"{args.runs} runs of labkit.jobs.train (tiny, 3 steps) cycling {len(configs)} "
          f"configs on 4 warm gloo ranks, {total:.0f} s (load avg {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores)")
    print(f"{'window':>8} {'runs':>9} {'median s':>9} {'p90 s':>7}   RSS per rank (MiB)")
    for name, xs in windows.items():
        first = {"start": 0, "middle": args.runs // 2, "end": args.runs - w}[name]
        ranks = " ".join(f"{v:7.1f}" for v in rss[name])
        print(f"{name:>8} {first:>4}-{first + w - 1:<4} {statistics.median(xs):9.3f} "
              f"{_p90(xs):7.3f}   {ranks}")
    print(f"{'after':>8} {'':9} {'':9} {'':7}   " + " ".join(f"{v:7.1f}" for v in rss["after"]))
    growth = [b - a for a, b in zip(rss["start"], rss["after"])]
    ratio = statistics.median(windows["end"]) / statistics.median(windows["start"])
    print("RSS growth start -> after per rank (MiB): " + " ".join(f"{g:+.1f}" for g in growth))
    print(f"RESULT soak_rss_growth_mib {max(growth):.1f}")
    print(f"RESULT soak_latency_ratio_end_over_start {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
