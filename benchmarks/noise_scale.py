"""What measuring the gradient noise scale costs a data-parallel step (claim C40).

``noise_scale=True`` adds two squared gradient norms per step on every rank (one pass over
the local gradients before the reduction, one over the reduced ones after it: float64
sums on the device, no host read) and one untraced all-reduce after training
(:mod:`labkit.train.noise_scale`). Same model, batch and mesh with it off and on,
alternating A B A B on one warm cluster; each run reports the median of its steady steps
(max over ranks); the table shows the median over runs and the fastest run of each (less
moved by other load on a shared machine). Prints ``RESULT noise_scale_overhead_pct <pct>``
(worst setting, from the fastest runs).
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
SETTINGS = [("tiny", 2, "ddp"), ("small", 2, "ddp"), ("small", 4, "ddp"), ("small", 4, "naive")]


def norm_pass_s(model: str, reps: int = 50) -> float:
    """Seconds for one step's two squared-norm passes over ``model``'s gradients (what
    ``NoiseScaleMeter`` adds to a rank's step), median of ``reps``, in this process."""
    import time

    import torch

    from labkit.config import preset
    from labkit.models import build_model
    from labkit.parallel.dp import unique_parameters
    from labkit.train.noise_scale import _sq_norm

    torch.set_num_threads(1)  # as one rank of a CPU cluster; more threads on 2 cores thrash
    params = [p for _, p in unique_parameters(build_model(preset(model)))]
    for p in params:
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        _sq_norm(params, "cpu").item()
        _sq_norm(params, "cpu").item()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    import labkit
    from labkit import jobs
    from labkit.config import RunConfig

    rows, worst = [], float("-inf")
    with labkit.Cluster(world_size=4, backend="gloo", device="cpu") as cluster:
        for model, dp, mode in SETTINGS:
            base = RunConfig(model=model, steps=STEPS, global_batch=8, measure_memory=False,
                             count_flops=False, dp_mode=mode).replace(dp=dp)
            cfgs = {False: base, True: base.replace(noise_scale=True)}
            for cfg in cfgs.values():  # warm-up
                cluster.run(jobs.train, cfg.replace(steps=2))
            times = {k: [] for k in cfgs}
            for i in range(REPS):
                for k in ((False, True) if i % 2 == 0 else (True, False)):
                    r = cluster.run(jobs.train, cfgs[k])
                    times[k].append(max(x["step_time_s"] for x in r.metrics))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            pct = 100 * (on / off - 1)
            fast = 100 * (min(times[True]) / min(times[False]) - 1)
            worst = max(worst, fast)
            rows.append((model, dp, mode, r.metrics[0]["n_params"], off, on, pct, fast))
    print(f"global batch 8, {STEPS} steps x {REPS} runs each, gloo on CPU")
    print(f"{'model':>6}{'dp':>4}{'mode':>7}{'params':>10}{'off ms':>9}{'on ms':>9}"
          f"{'median':>9}{'fastest':>9}")
    for model, dp, mode, n, off, on, pct, fast in rows:
        print(f"{model:>6}{dp:>4}{mode:>7}{n:>10}{1e3 * off:>9.2f}{1e3 * on:>9.2f}"
              f"{pct:>8.1f}%{fast:>8.1f}%")
    print("median/fastest: step time with noise_scale over without, minus 1")
    print(f"(load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores: a shared machine's "
          "timings move by several percent run to run)")
    for model in ("tiny", "small"):
        print(f"{model}: the two norm passes alone, one process: {1e3 * norm_pass_s(model):.3f} ms "
              "per step")
    print(f"RESULT noise_scale_overhead_pct {worst:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
