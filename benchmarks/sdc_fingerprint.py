"""Cost of the cross-replica fingerprint (silent data corruption check, labkit.faults.sdc).

The same data-parallel training (dp=2, 20 steps, no memory tracking or FLOP counting) runs
with ``fingerprint_every`` = 0 (off), 10 and 1, interleaved A B C A B C … so drift in the
machine's load hits all alike. Two measures:

* in the rank: the seconds the checks themselves took (checksums of the reduced gradients
  and the parameters, two 8-byte all-gathers), per check and as a share of the step;
* the checksum alone, in this process (no communication): the low-noise figure;
* end to end: the median steady step time (max over ranks) with the check every step and
  every 10 steps, against off (paired ratios, median over rounds).

Also the flight recorder's cost per collective (always on in a cluster's ranks), measured in
this process. Prints ``RESULT sdc_fingerprint_overhead_pct_every1 <percent>`` and the rest.
Usage: python benchmarks/sdc_fingerprint.py [--model tiny|small] [--rounds N]
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


def recorder_cost_s(n: int = 20000) -> float:
    """Seconds one collective's enter + exit record costs (labkit.faults.recorder)."""
    from labkit.faults.recorder import FlightRecorder

    with tempfile.TemporaryDirectory() as d:
        rec = FlightRecorder(os.path.join(d, "flight0"))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                rec.exit(rec.enter("all_reduce", (0, 1), 1024, 0.0), 0.0)
            best = min(best, (time.perf_counter() - t0) / n)
        return best


def checksum_cost_s(model: str) -> tuple:
    """(seconds, parameters): one checksum of ``model``'s parameters in this process, one
    thread, best of 20 (the check's arithmetic without the all-gather)."""
    import torch

    from labkit.config import preset
    from labkit.faults.sdc import checksum
    from labkit.models import build_model

    torch.set_num_threads(1)
    params = list(build_model(preset(model), seed=0).parameters())
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        checksum(params)
        best = min(best, time.perf_counter() - t0)
    return best, sum(p.numel() for p in params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    from labkit import Cluster, jobs
    from labkit.config import RunConfig

    base = RunConfig(model=args.model, parallel=dict(dp=2), steps=args.steps, global_batch=8,
                     measure_memory=False, count_flops=False, timeout_s=600)
    settings = (0, 10, 1)
    step: dict = {k: [] for k in settings}
    per_check: list = []
    share: list = []
    with Cluster(2, replace=False) as c:
        for k in settings:  # warm-up: build each config once
            c.run(jobs.train, base.replace(fingerprint_every=k))
        for _ in range(args.rounds):
            for k in settings:
                res = c.run(jobs.train, base.replace(fingerprint_every=k))
                step[k].append(max(m["step_time_s"] for m in res.metrics))
                if k == 1:
                    sdc = [m["sdc"] for m in res.metrics]
                    per = max(s["seconds"] / s["checks"] for s in sdc)
                    per_check.append(per)
                    # a step with the check does two of them (gradients, parameters)
                    share.append(2 * per / step[k][-1])
    med = {k: statistics.median(v) for k, v in step.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(step[k], step[0])) for k in (1, 10)}
    print(f"model {args.model}, dp=2, {args.steps} steps, {args.rounds} rounds")
    print(f"{'fingerprint_every':>18} {'step ms (median)':>17} {'overhead vs off':>16}")
    for k in settings:
        over = "—" if k == 0 else f"{(ratio[k] - 1) * 100:+.1f} %"
        print(f"{k or 'off':>18} {med[k] * 1e3:>17.2f} {over:>16}")
    rec = recorder_cost_s()
    cs, n = checksum_cost_s(args.model)
    print(f"one checksum of the {n:,} parameters alone (1 thread, this process): "
          f"{cs * 1e3:.3f} ms, {n * 4 / cs / 1e9:.1f} GB/s; the rest of a check is the "
          "all-gather, i.e. waiting for the slowest replica")
    print(f"one check (checksums + 8-byte all-gather), in the rank: "
          f"{statistics.median(per_check) * 1e3:.3f} ms; two per checked step = "
          f"{statistics.median(share) * 100:.1f} % of the step")
    print(f"flight recorder, per collective (enter + exit): {rec * 1e6:.2f} µs")
    print(f"RESULT sdc_fingerprint_overhead_pct_every1 {(ratio[1] - 1) * 100:.2f}")
    print(f"RESULT sdc_fingerprint_overhead_pct_every10 {(ratio[10] - 1) * 100:.2f}")
    print(f"RESULT sdc_check_ms {statistics.median(per_check) * 1e3:.3f}")
    print(f"RESULT sdc_check_share_of_step_pct {statistics.median(share) * 100:.2f}")
    print(f"RESULT flight_recorder_us_per_collective {rec * 1e6:.2f}")
    print(f"RESULT sdc_checksum_only_ms {cs * 1e3:.3f}")


if __name__ == "__main__":
    main()
