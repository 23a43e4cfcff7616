"""labkit's pipeline executor vs torch.distributed.pipelining, side by side in one run.

Same stages, data, optimizer and ranks — the one training job (:func:`labkit.jobs.train`)
with ``impl="labkit"`` and ``impl="torch"``; GPipe, 1F1B, interleaved 1F1B (V=2), ZB-V and
DualPipeV, each against PyTorch's schedule of the same name (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``; :class:`labkit.train.pipeline.TorchPipeline`). The runs alternate (labkit, torch, labkit, …) so drift on a shared machine hits
both. A step's time is the slowest rank's time for it; a run's time is
the median of its steady steps; the ratio is median(labkit) / median(torch) over the repeats.
Target: ratio <= 1.05 for GPipe, 1F1B and DualPipeV (claim C44); measured for the others.
DualPipeV needs microbatches >= 2 x pp (``--microbatches 8`` at ``--pp 4``); PyTorch's runtime
runs each of its overlapped forward/backward pairs one after the other, as labkit's executor
does, and its tied embedding (both on rank 0) gets the right gradient there.

ZB-V runs with untied embeddings: with the embedding and the head tied, ZB-V puts both on rank
0, and PyTorch's ZBV schedule (torch 2.13) then returns a wrong gradient for the shared weight
(its first-step loss matches, the next ones do not), and ``RunConfig.validate`` refuses it.

    python benchmarks/pipeline_vs_torch.py [--pp 4 --microbatches 8 --repeats 3]

Prints ``RESULT pipeline_vs_torch schedule=... labkit_ms=... torch_ms=... ratio=...``.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

import labkit
from labkit import jobs
from labkit.config import ModelConfig, RunConfig

TARGET = {"gpipe": 1.05, "1f1b": 1.05, "dualpipe-v": 1.05}


def step_time(result) -> float:
    """Median over steady steps of the slowest rank's step time (seconds)."""
    per_rank = [m["step_times"] for m in result.metrics]
    steps = len(per_rank[0])
    slowest = [max(t[s] for t in per_rank) for s in range(1, steps)]
    return statistics.median(slowest)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-v,dualpipe-v")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    with labkit.Cluster(args.pp, backend="gloo", device="cpu") as cluster:
        for name in args.schedules.split(","):
            mc = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=4,
                             seq_len=args.seq, name="pp-bench", tie_embeddings=name != "zb-v")
            cfg = RunConfig(model=mc, microbatches=args.microbatches, schedule=name,
                            global_batch=args.global_batch, steps=args.steps,
                            measure_memory=False, count_flops=False,
                            timeout_s=600).replace(pp=args.pp)
            theirs_cfg = cfg.replace(impl="torch")
            cluster.run(jobs.train, cfg.replace(steps=2))  # warm both paths
            cluster.run(jobs.train, theirs_cfg.replace(steps=2))
            ours, theirs, same = [], [], True
            for _ in range(args.repeats):
                a = cluster.run(jobs.train, cfg)
                b = cluster.run(jobs.train, theirs_cfg)
                ours.append(step_time(a))
                theirs.append(step_time(b))
                same &= max(abs(x - y) for x, y in zip(a.losses, b.losses)) < 1e-5
            lk, tt = statistics.median(ours), statistics.median(theirs)
            target = TARGET.get(name)
            verdict = (f"target<={target} {'PASS' if lk / tt <= target else 'FAIL'}"
                       if target else "measured")
            print(f"RESULT pipeline_vs_torch schedule={name} pp={args.pp} "
                  f"microbatches={args.microbatches} labkit_ms={lk * 1e3:.2f} "
                  f"torch_ms={tt * 1e3:.2f} ratio={lk / tt:.3f} "
                  f"ratios={[round(x / y, 3) for x, y in zip(ours, theirs)]} "
                  f"same_losses={same} {verdict} load={os.getloadavg()[0]:.2f}", flush=True)
            out.append({"schedule": name, "labkit_s": lk, "torch_s": tt, "ratio": lk / tt,
                        "same_losses": same})
    return out


if __name__ == "__main__":
    main()
