"""Tracing overhead on the tiny model's step time (target <= 5 %).

The same DP training (dp=2, tiny, 20 steps, no memory tracking or FLOP counting) runs with
the tracer on and off (``benchjobs.train_traced`` / ``train_untraced``), interleaved
A B B A ... so drift in machine load hits both alike. Each run reports the median of its
steady steps (max over ranks); the table shows the median over runs, and the overhead is
the median of the per-pair ratios traced/untraced (paired, so slow phases cancel).

A second, low-noise estimate: the cost of one traced region measured in this process, times
the events a step records.  Prints ``RESULT trace_overhead_pct <percent>``.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # benchjobs, importable by the ranks (Cluster passes sys.path)
sys.path.insert(0, os.path.dirname(HERE))

PAIRS = 15
TARGET_PCT = 5.0


def _region_cost_s(n: int = 20000) -> float:
    """Seconds one enabled ``region`` costs beyond a disabled one, in this process."""
    from labkit.trace import Tracer

    costs = {}
    for enabled in (False, True, False, True):
        tr = Tracer(0, None, enabled=enabled)
        t0 = time.perf_counter()
        for _ in range(n):
            with tr.region("x"):
                pass
        costs.setdefault(enabled, []).append((time.perf_counter() - t0) / n)
    return min(costs[True]) - min(costs[False])


def main() -> int:
    import labkit
    from labkit.config import RunConfig

    import benchjobs

    cfg = RunConfig(model="tiny", steps=20, global_batch=8, measure_memory=False,
                    count_flops=False).replace(dp=2)
    jobs = {"traced": benchjobs.train_traced, "untraced": benchjobs.train_untraced}
    times: dict = {k: [] for k in jobs}
    events_per_step = 0.0
    with labkit.Cluster(world_size=2, backend="gloo", device="cpu") as cluster:
        for name in jobs:  # warm-up: first-touch allocations, imports
            cluster.run(jobs[name], cfg)
        for i in range(PAIRS):
            order = ("traced", "untraced") if i % 2 == 0 else ("untraced", "traced")
            for name in order:
                r = cluster.run(jobs[name], cfg)
                times[name].append(max(m["step_time_s"] for m in r.metrics))
                if name == "traced":
                    events_per_step = len(r.trace.filter(rank=0, step=5))
    on, off = statistics.median(times["traced"]), statistics.median(times["untraced"])
    ratios = [a / b for a, b in zip(times["traced"], times["untraced"])]
    ratio = statistics.median(ratios)
    pct = 100.0 * (ratio - 1.0)
    cost = _region_cost_s()
    est = 100.0 * events_per_step * cost / off
    print(f"{'tracer':<10}{'runs':>5}{'step ms (median)':>18}{'min':>8}{'max':>8}")
    for name in jobs:
        ts = times[name]
        print(f"{name:<10}{len(ts):>5}{1e3 * statistics.median(ts):>18.2f}"
              f"{1e3 * min(ts):>8.2f}{1e3 * max(ts):>8.2f}")
    print(f"measured overhead: median of {len(ratios)} paired ratios traced/untraced = "
          f"{ratio:.4f} ({pct:+.2f} %); ratio of medians {on / off:.4f}; ratio of minima "
          f"{min(times['traced']) / min(times['untraced']):.4f}")
    print(f"estimate: {events_per_step:.0f} events/step x {1e6 * cost:.2f} us "
          f"per event = {est:.3f} % of a {1e3 * off:.1f} ms step")
    print(f"target <= {TARGET_PCT} % -> {'OK' if pct <= TARGET_PCT else 'MISSED'}  "
          f"(load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    print(f"RESULT trace_overhead_pct {pct:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
