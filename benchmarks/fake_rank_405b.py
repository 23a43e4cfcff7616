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
term for each, the activation peak beside the planner's, and wall/CPU seconds.

Measured (rank 1024, shared machine): without recomputation 72.68 GiB at the activations'
peak, the planner 72.34 GiB with labkit's terms and 71.78 GiB as Megatron-LM keeps them
(before labkit's layers kept what C18 counts: 151.53 GiB); with full recomputation 5.021
GiB against 4.926 (-1.9 %) and 4.348 (-13.4 %): the peak falls in the last microbatch's
forward, in a layer's working set of temporaries (0.648 GiB, more than the rebuilt layer's
0.536), which the planner now replays (labkit.plan.working_set) and finds to the byte; what
it leaves out is 3 receive buffers, the tracker's held input and the batch (0.095 GiB).
Before the planner held the working set: 4.84 GiB (-3.5 %); before labkit's layers kept
what C18 counts: 5.72 GiB measured.
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
                "layer working set": "layer working set", "rebuilt layer": "rebuilt layer",
                "rotary tables": "rotary tables", "receive buffers": None,
                "tracker-held inputs": None, "other": "output layer"}
WHY = {
    "kept layers": "full: each layer's input (Korthikanti et al. 2022 §5); none: block outputs",
    "stage outputs": "labkit keeps them until the flush ends; Megatron frees them at send",
    "rebuilt layer": "one layer rebuilt: C18's count plus the norms' 1/rms (labkit.plan."
                     "implementation)",
    "layer working set": "full: a running layer's forward temporaries (labkit.plan."
                         "working_set); none: what the layers keep",
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
    if cfg.checkpoint == "none":  # the planner counts each layer whole, its input included
        by_role = got["activations"]["by_role"]
        layers = by_role["kept layers"] + by_role["layer working set"]
        print(f"  {'layers, all parts':<20}{layers / GiB:9.3f}{terms['kept layers'] / GiB:9.3f}"
              f"   kept layers + working set: what C18 counts per layer, x layers x in flight")
    print(f"activations at their peak {got['activations']['peak'] / GiB:.3f} GiB; the planner: "
          f"{plan['activations'] / GiB:.3f} GiB with labkit's terms "
          f"({plan['activations'] / got['activations']['peak'] - 1:+.1%}), "
          f"{plan['activations_megatron'] / GiB:.3f} GiB as Megatron-LM keeps them "
          f"({plan['activations_megatron'] / got['activations']['peak'] - 1:+.1%})")
    print(f"RESULT fake_rank_405b rank={rank} checkpoint={cfg.checkpoint} "
          f"activation_peak={got['activations']['peak']} planned={plan['activations']:.0f} "
          f"megatron={plan['activations_megatron']:.0f}")
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
