"""labkit FSDP (ZeRO-3, :mod:`labkit.parallel.zero.fsdp`) vs PyTorch FSDP2 ``fully_shard``.

Same model (``small`` preset), same global batch (8), same units (every block, then the
root), same mesh: dp 2 and 4 (1-D), and HSDP 2 x 2 (2-D). All on one warm 4-rank gloo
cluster; the two implementations alternate A B A B ... and each run reports the median of
its steady steps (max over ranks); the table shows the median over runs and the ratio
labkit/torch (target <= 1.25). Prints ``RESULT fsdp_ratio <worst ratio>``.
"""
from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

REPS = 5
STEPS = 6
TARGET = 1.25
SETTINGS = [(2, 1), (4, 1), (4, 2)]  # (dp, hsdp replicas)


def main() -> int:
    import labkit
    from labkit import jobs
    from labkit.config import RunConfig

    run = RunConfig(model="small", steps=STEPS, global_batch=8, measure_memory=False,
                    count_flops=False)
    rows, worst = [], 0.0
    with labkit.Cluster(world_size=4, backend="gloo", device="cpu") as cluster:
        for dp, m in SETTINGS:
            cfgs = {impl: run.replace(dp=dp, zero_stage=3, impl=impl,
                                      **({"hsdp_replicas": m} if m > 1 else {}))
                    for impl in ("labkit", "torch")}
            for cfg in cfgs.values():  # warm-up (groups, meshes, lazy init)
                cluster.run(jobs.train, cfg.replace(steps=2))
            times: dict = {impl: [] for impl in cfgs}
            for i in range(REPS):
                for impl in (("labkit", "torch") if i % 2 == 0 else ("torch", "labkit")):
                    r = cluster.run(jobs.train, cfgs[impl])
                    times[impl].append(max(x["step_time_s"] for x in r.metrics))
            ours, theirs = statistics.median(times["labkit"]), statistics.median(times["torch"])
            paired = statistics.median(a / b for a, b in zip(times["labkit"], times["torch"]))
            worst = max(worst, ours / theirs)
            rows.append((dp, m, ours, theirs, ours / theirs, paired))
    print(f"model small, global batch 8, ZeRO-3, {STEPS} steps x {REPS} runs per "
          "implementation, prefetch on, root kept across the turn (as FSDP2)")
    print(f"{'dp':>3}{'mesh':>7}{'labkit ms':>11}{'torch ms':>10}{'ratio':>8}{'paired':>8}")
    for dp, m, a, b, ratio, paired in rows:
        flag = "" if ratio <= TARGET else "  > target"
        mesh = f"{m}x{dp // m}" if m > 1 else f"{dp}"
        print(f"{dp:>3}{mesh:>7}{1e3 * a:>11.2f}{1e3 * b:>10.2f}{ratio:>8.3f}{paired:>8.3f}"
              f"{flag}")
    print("ratio = median labkit / median torch; paired = median of per-pair ratios")
    print(f"target labkit/torch <= {TARGET} -> {'OK' if worst <= TARGET else 'MISSED'}  "
          f"(load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    print(f"RESULT fsdp_ratio {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
