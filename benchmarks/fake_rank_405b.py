"""Measured memory of one rank of Llama 3 405B at cluster scale, on this CPU, beside the
planner's prediction (labkit.measure.fake_rank).

Layout: TP8 x PP14 x DP128 = 14,336 ranks, sequence 8,192, microbatch 1, 16 microbatches
per pipeline (global batch 2,048 sequences = 16.8M tokens, Llama 3's), 1F1B, ZeRO-1, bf16
with fp32 master weights, sequence parallelism. labkit's pipeline needs equal stages, and
126 layers split evenly into 14 stages of 9 (Llama 3 itself ran 16 uneven ones). Rank 0
(first pipeline stage, the one 1F1B keeps the most microbatches in flight on) is measured.

    .venv/bin/python benchmarks/fake_rank_405b.py [--checkpoint full|none] [--rank R]

Prints bytes by category, measured vs planned, the relative error, and wall/CPU seconds.
"""
from __future__ import annotations

import argparse
import time

from labkit.config import ParallelConfig, RunConfig, preset
from labkit.measure.fake_rank import compare, fake_rank_memory, planned_rank_memory


def config(checkpoint: str = "full") -> RunConfig:
    return RunConfig(model=preset("llama3-405b"), parallel=ParallelConfig(tp=8, pp=14, dp=128),
                     global_batch=128 * 16, zero_stage=1, precision="bf16",
                     sequence_parallel=True, checkpoint=checkpoint, count_flops=False,
                     timeout_s=3600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="full", choices=("full", "none", "selective"))
    ap.add_argument("--rank", type=int, default=0)
    a = ap.parse_args()
    cfg = config(a.checkpoint)
    t0, c0 = time.perf_counter(), time.process_time()
    got = fake_rank_memory(cfg, a.rank)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    plan = planned_rank_memory(cfg, a.rank)
    rows = compare(got, plan)
    print(f"Llama 3 405B, tp8 x pp14 x dp128 = {got['world_size']:,} ranks, rank {a.rank} "
          f"{got['coords']}, checkpoint={a.checkpoint}, ZeRO-1 bf16, SP")
    print(f"this rank: {got['rank_params']:,} parameters (stage {got['stages']}, "
          f"{plan['layers']} layers)")
    print(f"{'category':<12}{'measured GiB':>14}{'planned GiB':>13}{'planned/meas-1':>16}")
    for c, r in rows.items():
        print(f"{c:<12}{r['measured'] / 2**30:>14.3f}{r['planned'] / 2**30:>13.3f}"
              f"{r['error']:>+16.4f}")
    peak = got["memory"]["peak"]
    print(f"peak total {got['memory']['peak_total'] / 2**30:.2f} GiB, of which 'other' "
          f"(backward temporaries, recomputed layers, buffers) {peak['other'] / 2**30:.2f} GiB; "
          f"planner comm buffers {plan['comm_buffers'] / 2**30:.2f} GiB, total "
          f"{plan['total'] / 2**30:.2f} GiB")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s (the machine was shared; CPU time is this "
          "process's)")


if __name__ == "__main__":
    main()
