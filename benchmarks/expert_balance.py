"""Expert load with and without the load-balancing loss, all-to-all bytes against the
formula, and expert memory per rank, from real training runs of the one job (claim C37).

For each aux-loss weight, trains ``tiny-moe`` (or ``--experts``/``--top-k`` variants) with
``labkit.train.run`` on ``--dp`` data ranks with the experts split over ``--ep`` of them, and
prints, per layer, the imbalance ``max/mean`` of the choices each expert received over all
ranks (first step, last step, mean of the last quarter), the choices dropped under
``--capacity``, the traced all-to-all bytes of the last step beside the formula from the
routed counts, and each rank's parameters (dense + experts/ep) beside the count.

    python benchmarks/expert_balance.py [--ep 2 --dp 2 --steps 60 --weights 0,0.01,0.1]

Prints ``RESULT expert_balance aux=... layer=... imbalance_first=... imbalance_last=...``.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import labkit
from labkit import train
from labkit.config import PRESETS, RunConfig
from labkit.models import count_params
from labkit.parallel.expert import (a2a_bytes_expected, a2a_bytes_from_trace, expert_numel,
                                    imbalance)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--dp", type=int, default=None, help="data ranks (default: ep)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--weights", default="0,0.01,0.1")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    dp = args.dp or args.ep
    torch.set_num_threads(1)
    out = []
    with labkit.Cluster(dp, backend="gloo", device="cpu") as cluster:
        for w in [float(v) for v in args.weights.split(",")]:
            mc = dataclasses.replace(PRESETS["tiny-moe"], n_experts=args.experts,
                                     top_k=args.top_k, capacity_factor=args.capacity,
                                     aux_loss_weight=w, name=f"tiny-moe-aux{w:g}")
            cfg = RunConfig(model=mc, parallel=dict(dp=dp, ep=args.ep), steps=args.steps,
                            lr=args.lr, global_batch=args.batch, count_flops=False,
                            measure_memory=False, timeout_s=1800)
            r = cluster.run(train.run, cfg)
            outs = r.outputs
            for layer in range(mc.n_layers):
                per_step = [imbalance([sum(o["routing"][s]["kept"][layer][e] for o in outs)
                                       for e in range(mc.n_experts)])
                            for s in range(cfg.steps)]
                tail = statistics.mean(per_step[-max(1, cfg.steps // 4):])
                dropped = sum(o["routing"][-1]["dropped"][layer] for o in outs)
                aux = statistics.mean(o["routing"][-1]["aux"][layer] for o in outs)
                loads = [sum(o["routing"][-1]["kept"][layer][e] for o in outs)
                         for e in range(mc.n_experts)]
                line = (f"RESULT expert_balance ep={args.ep} dp={dp} E={mc.n_experts} "
                        f"k={mc.top_k} aux={w} layer={layer} imbalance_first={per_step[0]:.3f} "
                        f"imbalance_last={per_step[-1]:.3f} imbalance_tail_mean={tail:.3f} "
                        f"aux_last={aux:.4f} loads_last={loads} dropped_last={dropped} "
                        f"loss_last={r.losses[-1]:.4f}")
                print(line, flush=True)
                out.append(line)
            last = cfg.steps - 1
            full = expert_numel(mc)
            for rank, m in enumerate(r.metrics):
                got = sum(v[0] for v in a2a_bytes_from_trace(r.trace.events, rank=rank,
                                                              step=last).values())
                want = sum(v[0] for v in a2a_bytes_expected(r, rank, last).values())
                print(f"RESULT expert_bytes aux={w} rank={rank} step={last} traced_sent={got:.0f} "
                      f"formula_sent={want} equal={got == want} rank_params={m['rank_params']} "
                      f"dense_plus_experts_over_ep={count_params(mc) - full + full // args.ep} "
                      f"full_expert_params={full}", flush=True)
    return out


if __name__ == "__main__":
    main()
