"""The one training job against the three dedicated jobs it replaced, side by side.

Before the redesign labkit had a data-parallel job, a ZeRO/FSDP job and a pipeline job.
The one job composes all three; composing must cost no speed. On one warm 4-rank cluster,
each setting runs the dedicated job (``labkit.train._old.run``,
``labkit.parallel.zero_jobs.zero_train``, ``labkit.parallel.pipeline.jobs.pipeline_train``)
and the one job (``labkit.jobs.train``) alternately, A B A B ..., on the same model, batch
and steps; each run reports its median steady step (max over ranks). Target: one job /
dedicated <= 1.05. Prints ``RESULT one_job_vs_dedicated_worst_ratio <ratio>``.

(Kept while the dedicated jobs exist in the tree; it is how their removal was justified.)
"""
from __future__ import annotations

import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

REPS = 7
STEPS = 6
TARGET = 1.05


def settings():
    from labkit.config import RunConfig
    from labkit.parallel.pipeline.config import PipelineConfig
    from labkit.parallel.zero_config import ZeroConfig

    base = RunConfig(model="small", steps=STEPS, global_batch=8, measure_memory=False,
                     count_flops=False)
    pp_model = "small"
    return [
        ("dp=4 DDP", "labkit.train._old:run", base.replace(dp=4), base.replace(dp=4)),
        ("dp=4 ZeRO-3", "labkit.parallel.zero_jobs:zero_train",
         ZeroConfig(run=base.replace(dp=4), zero_stage=3), base.replace(dp=4, zero_stage=3)),
        ("pp=4 1F1B M=8", "labkit.parallel.pipeline.jobs:pipeline_train",
         PipelineConfig(model=pp_model, pp=4, microbatches=8, global_batch=8, steps=STEPS,
                        measure_memory=False),
         base.replace(pp=4, micro_batch=1, schedule="1f1b")),
    ]


def main() -> int:
    import labkit
    from labkit import jobs

    rows, worst = [], 0.0
    with labkit.Cluster(world_size=4, backend="gloo", device="cpu") as cluster:
        for name, old_job, old_cfg, new_cfg in settings():
            runs = {"old": (old_job, old_cfg), "new": (jobs.train, new_cfg)}
            for job, cfg in runs.values():  # warm-up
                cluster.run(job, cfg)
            times = {k: [] for k in runs}
            for i in range(REPS):
                for k in (("old", "new") if i % 2 == 0 else ("new", "old")):
                    job, cfg = runs[k]
                    r = cluster.run(job, cfg)
                    times[k].append(max(x["step_time_s"] for x in r.metrics))
            old, new = statistics.median(times["old"]), statistics.median(times["new"])
            paired = statistics.median(b / a for a, b in zip(times["old"], times["new"]))
            worst = max(worst, new / old)
            rows.append((name, old, new, new / old, paired))
    print(f"model small, global batch 8, {STEPS} steps x {REPS} runs per job, 4 ranks")
    print(f"{'setting':<16}{'dedicated ms':>14}{'one job ms':>12}{'ratio':>8}{'paired':>8}")
    for name, old, new, ratio, paired in rows:
        flag = "" if ratio <= TARGET else "  > target"
        print(f"{name:<16}{1e3 * old:>14.2f}{1e3 * new:>12.2f}{ratio:>8.3f}{paired:>8.3f}{flag}")
    print(f"target one job / dedicated <= {TARGET} -> {'OK' if worst <= TARGET else 'MISSED'}"
          f"  (load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    print(f"RESULT one_job_vs_dedicated_worst_ratio {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
