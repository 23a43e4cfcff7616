"""Expert load with and without the load-balancing loss, all-to-all bytes against the
formula, and expert memory per rank, from real expert-parallel training runs (claim C37).

For each aux-loss weight, trains ``tiny-moe`` (or ``--experts``/``--top-k`` variants) with
expert parallelism over ``--ep`` ranks and prints, per layer, the imbalance ``max/mean`` of
the tokens each expert received over all ranks (first step, last step, mean of the last
quarter), the tokens dropped under ``--capacity``, the traced all-to-all bytes of the last
step beside the formula from the routed counts, and each rank's expert bytes.

    python benchmarks/expert_balance.py [--ep 2 --steps 60 --weights 0,0.01,0.1]

Prints ``RESULT expert_balance aux=... layer=... imbalance_first=... imbalance_last=...``.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import labkit
from labkit.config import PRESETS
from labkit.parallel.expert import a2a_bytes_formula, a2a_bytes_from_trace, imbalance
from labkit.parallel.expert.jobs import ExpertRunConfig, train


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--weights", default="0,0.01,0.1")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--capacity", type=float, default=None)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    with labkit.Cluster(args.ep, backend="gloo", device="cpu") as cluster:
        for w in [float(v) for v in args.weights.split(",")]:
            mc = dataclasses.replace(PRESETS["tiny-moe"], n_experts=args.experts,
                                     top_k=args.top_k, capacity_factor=args.capacity,
                                     aux_loss_weight=w)
            cfg = ExpertRunConfig(model=mc, ep=args.ep, steps=args.steps, lr=args.lr,
                                  global_batch=args.batch, timeout_s=1800)
            r = cluster.run(train, cfg)
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
                line = (f"RESULT expert_balance ep={args.ep} E={mc.n_experts} k={mc.top_k} "
                        f"aux={w} layer={layer} imbalance_first={per_step[0]:.3f} "
                        f"imbalance_last={per_step[-1]:.3f} imbalance_tail_mean={tail:.3f} "
                        f"aux_last={aux:.4f} loads_last={loads} dropped_last={dropped} "
                        f"loss_last={sum(o['losses'][-1] for o in outs):.4f}")
                print(line, flush=True)
                out.append(line)
            last = cfg.steps - 1
            for rank, o in enumerate(outs):
                traced = a2a_bytes_from_trace(r.trace.events, rank=rank, step=last)
                want = sum(a2a_bytes_formula([p["routing"][last]["kept"][layer] for p in outs],
                                             rank, o["d_model"], o["elem_bytes"])["sent"]
                           for layer in range(mc.n_layers))
                got = sum(v[0] for v in traced.values())
                print(f"RESULT expert_bytes aux={w} rank={rank} step={last} traced_sent={got:.0f} "
                      f"formula_sent={want} equal={got == want} "
                      f"expert_bytes={o['info']['expert_bytes']} "
                      f"full_expert_bytes={o['info']['full_expert_numel'] * o['elem_bytes']}",
                      flush=True)
    return out


if __name__ == "__main__":
    main()
