"""Measured vs simulated pipeline bubble for every schedule, P=4, M in {4, 8}.

The measured bubble comes from the recorded F/B/W spans of a real run
(:func:`labkit.parallel.pipeline.bubble.measure_bubble`); the simulated one from the same
schedule fed each stage's measured mean F/B/W cost and, per cross-rank hop, the
separately measured one-way time of one boundary tensor (``simulated``; ``gap_pp`` is
measured − simulated; ``simulated_no_comm`` without the hop time). ``explained`` replaces
the ping-pong hop time by the executor's overheads measured from the trace (``hop_ms``:
producer end to consumer start when the consumer waited; ``dispatch_ms``: the gap
between two spans of one rank otherwise). ``replayed`` re-simulates with every span's own
duration and no communication. Also prints measured peak activation memory per rank.
The issue's target: |gap_pp| <= 3 for GPipe and 1F1B at P=4, M in {4, 8}.

    python benchmarks/pipeline_bubble.py [--pp 4 --microbatches 4,8]

Prints ``RESULT pipeline_bubble schedule=... M=... measured=... simulated=... gap_pp=...``.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

import labkit
from labkit.parallel.pipeline import jobs as pj
from labkit.parallel.pipeline.bubble import measure_bubble
from labkit.parallel.pipeline.config import PP_BALANCED, PipelineConfig
from labkit.parallel.pipeline.schedules import SCHEDULES


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=PP_BALANCED.n_layers)
    ap.add_argument("--d-model", type=int, default=PP_BALANCED.d_model)
    ap.add_argument("--seq", type=int, default=PP_BALANCED.seq_len)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    mc = dataclasses.replace(PP_BALANCED, n_layers=args.layers, d_model=args.d_model,
                             seq_len=args.seq)
    out = []
    with labkit.Cluster(args.pp, backend="gloo", device="cpu") as cluster:
        for m in [int(v) for v in args.microbatches.split(",")]:
            for name in args.schedules.split(","):
                cfg = PipelineConfig(model=mc, pp=args.pp, microbatches=m, schedule=name,
                                     global_batch=m * args.micro_batch, steps=args.steps,
                                     timeout_s=600)
                r = cluster.run(pj.pipeline_train, cfg)
                lat = r.metrics[0]["p2p_latency_s"]
                rep0 = measure_bubble(r.trace, cfg.build_schedule())
                rep = measure_bubble(r.trace, cfg.build_schedule(), comm=lat)
                mem = [mt["peak_activation_bytes"] / 2**20 for mt in r.metrics]
                inflight = [mt["peak_inflight"] for mt in r.metrics]
                print(f"RESULT pipeline_bubble schedule={name} P={args.pp} M={m} "
                      f"V={cfg.stages_per_rank} measured={rep.bubble:.3f} "
                      f"simulated={rep.predicted_bubble:.3f} gap_pp={rep.gap_pp:+.1f} "
                      f"simulated_no_comm={rep0.predicted_bubble:.3f} "
                      f"p2p_latency_ms={lat * 1e3:.2f} explained={rep.explained.bubble:.3f} "
                      f"explained_gap_pp={rep.explained_gap_pp:+.1f} "
                      f"hop_ms={rep.hop_s * 1e3:.2f} dispatch_ms={rep.dispatch_s * 1e3:.2f} "
                      f"replayed={rep.replayed_bubble:.3f} "
                      f"mfu_ceiling={rep.mfu_ceiling:.3f} "
                      f"idle_ms={[round(i * 1e3, 1) for i in rep.idle]} "
                      f"sim_idle_ms={[round(i * 1e3, 1) for i in rep.predicted.idle]} "
                      f"peak_act_MiB={[round(x, 2) for x in mem]} inflight={inflight}",
                      flush=True)
                out.append({"schedule": name, "M": m, "measured": rep.bubble,
                            "simulated": rep.predicted_bubble, "gap_pp": rep.gap_pp,
                            "explained": rep.explained.bubble,
                            "explained_gap_pp": rep.explained_gap_pp,
                            "mfu_ceiling": rep.mfu_ceiling, "peak_act_bytes": mem,
                            "inflight": inflight})
    return out


if __name__ == "__main__":
    main()
