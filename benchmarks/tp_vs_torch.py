"""labkit's tensor parallelism vs PyTorch's ``parallelize_module``, side by side in one run.

Same GPT, batch, optimizer and ranks (CPU, gloo, tp=2), with and without sequence
parallelism. Runs alternate (labkit, torch, torch, labkit, …) so drift on a shared machine
hits both. A step's time is the slowest rank's (each step starts at a barrier); a run's time
is the median of its steady steps; the ratio is median(labkit) / median(torch) over the
repeats. Target: ratio <= 1.1. Both implementations' losses are printed side by side (they
must agree: same model, same data).

    python benchmarks/tp_vs_torch.py [--tp 2 --layers 4 --d-model 256 --seq 128 --repeats 5]

Prints ``RESULT tp_vs_torch sp=... labkit_ms=... torch_ms=... ratio=...``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

TARGET = 1.1


def run_time(result) -> float:
    """Median over steady steps (all but the first two) of the slowest rank's step time (s)."""
    per_rank = [o["step_times"] for o in result.outputs]
    slowest = [max(t[s] for t in per_rank) for s in range(2, len(per_rank[0]))]
    return statistics.median(slowest)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import labkit
    from benchjobs.tp import TPBench, tp_step_times
    from labkit.config import ModelConfig

    model = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                        seq_len=args.seq, vocab_size=256, name="tp-bench")
    rows = []
    with labkit.Cluster(world_size=args.tp, backend="gloo", device="cpu") as cluster:
        for sp in (False, True):
            cfgs = {impl: TPBench(model=model, impl=impl, sp=sp, batch=args.batch,
                                  steps=args.steps) for impl in ("labkit", "torch")}
            for cfg in cfgs.values():  # warm-up: imports, allocator
                cluster.run(tp_step_times, cfg)
            times = {impl: [] for impl in cfgs}
            loss = {}
            for i in range(args.repeats):
                for impl in (("labkit", "torch") if i % 2 == 0 else ("torch", "labkit")):
                    r = cluster.run(tp_step_times, cfgs[impl])
                    times[impl].append(run_time(r))
                    loss[impl] = r.outputs[0]["losses"][-1]
            ours, theirs = statistics.median(times["labkit"]), statistics.median(times["torch"])
            paired = statistics.median(a / b for a, b in zip(times["labkit"], times["torch"]))
            rows.append((sp, ours, theirs, ours / theirs, paired, loss["labkit"], loss["torch"]))
    print(f"GPT L={args.layers} H={args.d_model} A={args.heads} S={args.seq}, batch "
          f"{args.batch}, tp={args.tp}, {args.steps} steps x {args.repeats} runs each")
    print(f"{'sp':>5}{'labkit ms':>11}{'torch ms':>10}{'ratio':>8}{'paired':>8}"
          f"{'loss labkit':>13}{'loss torch':>12}")
    for sp, a, b, ratio, paired, la, lt in rows:
        flag = "" if ratio <= TARGET else "  > target"
        print(f"{str(sp):>5}{1e3 * a:>11.2f}{1e3 * b:>10.2f}{ratio:>8.3f}{paired:>8.3f}"
              f"{la:>13.6f}{lt:>12.6f}{flag}")
    print(f"ratio = median labkit / median torch; paired = median of per-repeat ratios. "
          f"target <= {TARGET}  (load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          "other jobs share this machine)")
    for sp, a, b, ratio, *_ in rows:
        print(f"RESULT tp_vs_torch sp={sp} labkit_ms={1e3 * a:.2f} torch_ms={1e3 * b:.2f} "
              f"ratio={ratio:.3f}")
    return rows


if __name__ == "__main__":
    main()
