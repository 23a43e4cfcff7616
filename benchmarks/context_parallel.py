"""Context-parallel attention, per method and split: work per rank, bytes, K/V working set,
and (ring) the share of send/recv time hidden under block computation.

One attention forward and backward per configuration (global shapes, before tensor
parallelism), repeated ``--repeats`` times; work and bytes are exact (and equal the formulas,
which the report checks), the overlap is a timing and varies with the machine's load.

    python benchmarks/context_parallel.py [--cp 4 --seq 1024 --heads 8 --kv-heads 4 --dim 64]

Prints ``RESULT context_parallel method=... split=... work=[...] imbalance=...
sent_fwd=... sent_bwd=... formula=ok kv_fwd=... kv_bwd=...`` and, for the ring,
``overlap_fwd=mean[min-max] overlap_bwd=...`` over ranks and repeats.
"""
from __future__ import annotations

import argparse

import torch

import labkit
from labkit.parallel.context import METHODS, jobs
from labkit.parallel.context.report import attention_report


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    with labkit.Cluster(args.cp, backend="gloo", device="cpu") as cluster:
        for method in METHODS:
            for zigzag in (False, True):
                case = jobs.AttentionCase(method=method, zigzag=zigzag, cp=args.cp,
                                          batch=args.batch, n_heads=args.heads,
                                          n_kv_heads=args.kv_heads, seq_len=args.seq,
                                          head_dim=args.dim)
                reps = [attention_report(jobs.run(cluster, case)) for _ in range(args.repeats)]
                rep = reps[-1]
                ok = rep["bytes"] == rep["bytes_formula"] and rep["work"] == rep["work_formula"] \
                    and rep["kv_bytes"] == rep["kv_formula"]
                line = (f"RESULT context_parallel method={method} "
                        f"split={'zigzag' if zigzag else 'contiguous'} cp={args.cp} "
                        f"work={rep['work']} imbalance={rep['imbalance']:.3f} "
                        f"sent_fwd={rep['bytes'][0]['forward']:.0f} "
                        f"sent_bwd={rep['bytes'][0]['backward']:.0f} "
                        f"formula={'ok' if ok else 'MISMATCH'} "
                        f"kv_fwd={rep['kv_bytes'][0]['forward']} "
                        f"kv_bwd={rep['kv_bytes'][0]['backward']}")
                if rep["overlap"]:
                    for ph in ("forward", "backward"):
                        vals = [o[ph] for r in reps for o in r["overlap"]]
                        line += f" overlap_{ph[0]}wd={sum(vals) / len(vals):.2f}" \
                                f"[{min(vals):.2f}-{max(vals):.2f}]"
                print(line, flush=True)
                out.append(rep)
    return out


if __name__ == "__main__":
    main()
