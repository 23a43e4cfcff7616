"""Measured memory of one rank of Llama 3 405B at cluster scale, on this CPU, beside the
planner's prediction (labkit.measure.fake_rank).

Layout: Llama 3's (Dubey et al. 2024, Table 4): TP8 x PP16 x DP128 = 16,384 ranks, sequence
8,192, microbatch 1, 16 microbatches per pipeline (global batch 2,048 sequences = 16.8M
tokens), 1F1B, ZeRO-1, bf16 with fp32 master weights, sequence parallelism, full
recomputation. The 126 layers split 7, 8, ..., 8, 7 (one fewer on the first and last stage).

By default two ranks are measured: rank 1024 (pipeline rank 1: 8 layers, 15 microbatches in
flight, the rank the planner finds fullest, so the one its per-GPU figure describes) and
rank 0 (the first stage: 7 layers and the embedding, 16 in flight).

    .venv/bin/python benchmarks/fake_rank_405b.py [--rank R ...] [--checkpoint full|none]

Prints, per rank: bytes by category, measured vs planned (with labkit's own terms, and as
Megatron-LM keeps activations), the activations at their peak by role beside the planner's
term for each, and wall/CPU seconds of the measurement.
"""
from __future__ import annotations

import argparse
import time

from labkit.config import ParallelConfig, RunConfig, preset
from labkit.measure.activation_roles import ROLES
from labkit.measure.fake_rank import compare, fake_rank_memory, planned_rank_memory

GiB = 2 ** 30
#: the planner's term for each measured role (None: labkit keeps it, the planner does not)
PLANNED_TERM = {"kept layers": "kept layers", "stage outputs": "stage outputs",
                "layer working set": None, "rebuilt layer": "rebuilt layer",
                "rotary tables": "rotary tables", "receive buffers": None,
                "tracker-held inputs": None, "other": "output layer"}
WHY = {
    "kept layers": "each layer's input, as in Megatron-LM (Korthikanti et al. 2022 §5)",
    "stage outputs": "labkit keeps them until the flush ends; Megatron frees them at send",
    "rebuilt layer": "labkit's block: gathered SP inputs, fp32 norm copies, repeated K/V",
    "layer working set": "a running layer's forward temporaries (full recomputation)",
    "receive buffers": "the executor posts receives ahead of need (not modelled)",
    "tracker-held inputs": "torch's tracker keeps received inputs until the step ends",
    "rotary tables": "rope_slice indexes cos/sin per forward (SP)",
    "other": "batch, token ids; on the last stage the loss",
}


def config(checkpoint: str = "full", pp: int = 16) -> RunConfig:
    return RunConfig(model=preset("llama3-405b"), parallel=ParallelConfig(tp=8, pp=pp, dp=128),
                     global_batch=128 * 16, zero_stage=1, precision="bf16",
                     sequence_parallel=True, checkpoint=checkpoint, count_flops=False,
                     timeout_s=3600)


def report(cfg: RunConfig, rank: int) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    got = fake_rank_memory(cfg, rank)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    plan = planned_rank_memory(cfg, rank)
    rows = compare(got, plan)
    print(f"\n== rank {rank} of {got['world_size']:,} {got['coords']}: stage {got['stages']}, "
          f"{plan['layers']} layers, {got['rank_params']:,} parameters")
    print(f"{'category':<24}{'measured GiB':>13}{'planned GiB':>13}{'planned/meas-1':>16}")
    for c, r in rows.items():
        print(f"{c:<24}{r['measured'] / GiB:>13.3f}{r['planned'] / GiB:>13.3f}"
              f"{r['error']:>+16.4f}")
    terms = plan["activation_terms"]
    print(f"activations at their peak, by role ({got['activations']['peak'] / GiB:.3f} GiB):")
    for role in ROLES:
        meas = got["activations"]["by_role"][role]
        key = PLANNED_TERM[role]
        planned = f"{terms.get(key, 0.0) / GiB:9.3f}" if key else "        -"
        print(f"  {role:<20}{meas / GiB:9.3f}{planned}   {WHY[role]}")
    mem = got["memory"]
    print(f"tracked peak total {mem['peak_total'] / GiB:.2f} GiB (activations then "
          f"{mem['peak']['activations'] / GiB:.3f}, 'other' {mem['peak']['other'] / GiB:.2f}); "
          f"planner total {plan['total'] / GiB:.2f} GiB")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s (the machine was shared; CPU time is this "
          "process's)")
    return {"rows": rows, "cpu_s": cpu, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="full", choices=("full", "none"))
    ap.add_argument("--rank", type=int, nargs="+", default=[1024, 0])
    a = ap.parse_args()
    cfg = config(a.checkpoint)
    print(f"Llama 3 405B, tp8 x pp16 x dp128 = {cfg.parallel.world_size:,} ranks, "
          f"checkpoint={a.checkpoint}, ZeRO-1 bf16, SP, 1F1B, 16 microbatches")
    for r in a.rank:
        report(cfg, r)


if __name__ == "__main__":
    main()
