"""labkit's DDP-style data parallelism vs ``torch.nn.parallel.DistributedDataParallel``.

Same model (``small`` preset), same global batch (8), same bucket capacity; settings
dp in {2, 4} x bucket in {25, 1} MiB, all on one warm 4-rank cluster. The two
implementations alternate A B A B ... and each run reports the median of its steady steps
(max over ranks); the table shows the median over runs and the ratio labkit/torch
(target <= 1.1). Prints ``RESULT ddp_vs_torch_worst_ratio <ratio>``.
"""
from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

REPS = 7
STEPS = 6
TARGET = 1.1
SETTINGS = [(2, 25.0), (2, 1.0), (4, 25.0), (4, 1.0)]


def main() -> int:
    import labkit
    from labkit import jobs
    from labkit.config import RunConfig

    base = RunConfig(model="small", steps=STEPS, global_batch=8, measure_memory=False,
                     count_flops=False)
    rows, worst = [], 0.0
    with labkit.Cluster(world_size=4, backend="gloo", device="cpu") as cluster:
        for dp, bucket in SETTINGS:
            cfgs = {m: base.replace(dp=dp, bucket_mb=bucket,
                                    impl="torch" if m == "torch" else "labkit")
                    for m in ("ddp", "torch")}
            for cfg in cfgs.values():  # warm-up
                cluster.run(jobs.train, cfg.replace(steps=2))
            times = {m: [] for m in cfgs}
            nbuckets = {}
            for i in range(REPS):
                for m in (("ddp", "torch") if i % 2 == 0 else ("torch", "ddp")):
                    r = cluster.run(jobs.train, cfgs[m])
                    times[m].append(max(x["step_time_s"] for x in r.metrics))
                    nbuckets[m] = len(r.trace.filter(rank=0, step=2, op="all_reduce"))
            ours, theirs = statistics.median(times["ddp"]), statistics.median(times["torch"])
            paired = statistics.median(a / b for a, b in zip(times["ddp"], times["torch"]))
            worst = max(worst, ours / theirs)
            rows.append((dp, bucket, nbuckets["ddp"], nbuckets["torch"], ours, theirs,
                         ours / theirs, paired, min(times["ddp"]) / min(times["torch"])))
    print(f"model small, global batch 8, {STEPS} steps x {REPS} runs per implementation")
    print(f"{'dp':>3}{'bucket MiB':>11}{'buckets l/t':>12}{'labkit ms':>11}{'torch ms':>10}"
          f"{'ratio':>8}{'paired':>8}{'minima':>8}")
    for dp, bucket, bl, bt, a, b, ratio, paired, mins in rows:
        flag = "" if ratio <= TARGET else "  > target"
        print(f"{dp:>3}{bucket:>11g}{f'{bl}/{bt}':>12}{1e3 * a:>11.2f}{1e3 * b:>10.2f}"
              f"{ratio:>8.3f}{paired:>8.3f}{mins:>8.3f}{flag}")
    print("ratio = median labkit / median torch; paired = median of per-pair ratios; "
          "minima = fastest run / fastest run")
    print(f"target labkit/torch <= {TARGET} -> {'OK' if worst <= TARGET else 'MISSED'}  "
          f"(load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    print(f"RESULT ddp_vs_torch_worst_ratio {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
