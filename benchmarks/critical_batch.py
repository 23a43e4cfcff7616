"""Steps to a target loss at several global batches, against McCandlish et al. 2018's
``S/S_min = 1 + B_noise/B`` (claim C40).

Real training runs of the job on a warm 2-rank cluster (data parallelism, ``dp=2``), one per
global batch ``B``; the batch grows by gradient accumulation (micro-batch ``min(4, B/2)``),
the learning rate is the same for every ``B``. Each run also measures the gradient noise
scale ``B_simple`` from its two data ranks (:mod:`labkit.train.noise_scale`). For each ``B``:
the steps until the smoothed training loss first reaches ``--target``
(:func:`labkit.train.critical_batch.steps_to_target`). Then, from those pairs:

* the curve with ``B_noise`` = the measured noise scale (median over the runs of the
  smoothed ``B_simple`` up to the target) and the least-squares ``S_min`` for it;
* the free fit of ``S_min`` and ``B_crit`` (:func:`fit_steps_curve`).

The paper's model assumes each batch trains at its own best learning rate; one fixed
Adam learning rate for all is a cheaper stand-in, said beside the table.

    python benchmarks/critical_batch.py                       # ViT on digits
    python benchmarks/critical_batch.py --model tiny --target 2.6 --lr 3e-3

Prints a table and ``RESULT b_noise_measured <B>``, ``RESULT b_crit_fit <B>``.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def sweep(cluster, model: str, batches: list, target: float, lr: float, max_steps: int,
          seed: int = 0) -> list:
    """One run per global batch: ``[{"B", "steps", "b_simple", "final", "seconds"}]``."""
    import labkit as lk
    from labkit.train.critical_batch import smoothed, steps_to_target

    rows = []
    for b in batches:
        dataset = "digits" if model.startswith("vit") else "text"
        cfg = lk.RunConfig(model=model, dataset=dataset, steps=max_steps, global_batch=b,
                           micro_batch=min(4, b // 2), lr=lr, seed=seed, noise_scale=True,
                           measure_memory=False, count_flops=False,
                           timeout_s=3600).replace(dp=2)
        t0 = time.perf_counter()
        r = cluster.run(lk.jobs.train, cfg)
        s = steps_to_target(r.losses, target)
        ns = r.metrics[0]["noise_scale"]["b_simple"]
        # the smoothed estimate is undefined (nan) until its averages have a value
        upto = [x for x in (ns[:s] if s else ns) if math.isfinite(x)]
        rows.append({"B": b, "steps": s,
                     "b_simple": statistics.median(upto) if upto else math.nan,
                     "final": smoothed(r.losses)[-1], "seconds": time.perf_counter() - t0})
        print(f"  ran B={b}: steps to target {s}, median B_simple {rows[-1]['b_simple']:.1f}, "
              f"{rows[-1]['seconds']:.0f} s", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit-digits")
    ap.add_argument("--batches", default="4,8,16,32,64")
    ap.add_argument("--target", type=float, default=1.0, help="smoothed training loss, nats")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-steps", type=int, default=400)
    args = ap.parse_args(argv)

    import torch

    import labkit as lk
    from labkit.train.critical_batch import (fit_steps_curve, predicted_steps,
                                             s_min_given_noise)

    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    with lk.Cluster(2) as cluster:
        rows = sweep(cluster, args.model, batches, args.target, args.lr, args.max_steps)
    hit = [r for r in rows if r["steps"]]
    print(f"{args.model}, dp=2, lr={args.lr}, target smoothed loss {args.target} nats, "
          f"at most {args.max_steps} steps")
    finite = [r["b_simple"] for r in rows if math.isfinite(r["b_simple"])]
    b_noise = statistics.median(finite) if finite else math.nan
    s_min = s_min_given_noise([r["B"] for r in hit], [r["steps"] for r in hit], b_noise) \
        if hit and finite else math.nan
    print(f"{'B':>4} {'steps':>6} {'S_min(1+B_noise/B)':>19} {'B_simple':>9} "
          f"{'final loss':>10} {'s':>6}")
    for r in rows:
        pred = predicted_steps(r["B"], s_min, b_noise) if math.isfinite(s_min) else math.nan
        print(f"{r['B']:>4} {r['steps'] or '—':>6} {pred:>19.1f} {r['b_simple']:>9.1f} "
              f"{r['final']:>10.3f} {r['seconds']:>6.1f}")
    print(f"B_noise (median measured B_simple) = {b_noise:.1f}; S_min for it = {s_min:.1f}")
    print(f"RESULT b_noise_measured {b_noise:.2f}")
    if len({r['B'] for r in hit}) >= 2:
        try:
            fs, fb = fit_steps_curve([r["B"] for r in hit], [r["steps"] for r in hit])
            print(f"free fit: S_min = {fs:.1f}, B_crit = {fb:.1f}")
            print(f"RESULT b_crit_fit {fb:.2f}")
        except ValueError as e:
            print(f"free fit refused: {e}")
    print("one fixed Adam learning rate for every B (the paper tunes it per batch size)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
