"""A seeded random sweep of training-job compositions against the independent oracle.

Draws ``--n`` random compositions over every dimension the matrix knows
(tests/oracle/matrix.py: dp, ZeRO, HSDP, tp ± sp, cp × method × zigzag, pp × schedule ×
virtual stages, ep, tied/untied, GQA, dense/top-1/top-2/capacity, fp32/bf16, checkpoint
policies, impl, accumulation) on up to ``--max-ranks`` ranks. Each one either is refused by
``validate`` (counted) or runs on a warm cluster and is checked on every rank against the
oracle (tests/oracle/check.py). Prints every disagreement, whether it is a diagnosed
defect (``known_defects``), and a summary line:

    python benchmarks/matrix_sweep.py --n 40 --seed 1      (or: make sweep)
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40, help="compositions to draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-ranks", type=int, default=8)
    ap.add_argument("--pairwise", action="store_true",
                    help="run the CI's all-pairs set (4 ranks) instead of random draws")
    args = ap.parse_args()

    import torch

    import labkit
    from labkit import jobs
    from oracle.check import disagreements
    from oracle.matrix import known_defects, label, pairwise, random_configs

    torch.set_num_threads(1)
    start = time.time()
    configs = (pairwise(4) if args.pairwise
               else random_configs(args.n, args.seed, args.max_ranks))
    tally = {"refused": 0, "agree": 0, "known": 0, "new": 0, "raised": 0}
    clusters: dict = {}
    try:
        for i, cfg in enumerate(configs):
            name = label(cfg)
            try:
                cfg.validate(args.max_ranks)
            except ValueError as e:
                tally["refused"] += 1
                print(f"[{i}] refused  {name}: {str(e)[:120]}")
                continue
            size = 4 if cfg.parallel.world_size <= 4 else 8
            if size not in clusters:
                clusters[size] = labkit.Cluster(size, backend="gloo", device="cpu",
                                                replace=False)
            try:
                bad = disagreements(clusters[size].run(jobs.train, cfg), cfg)
            except Exception as e:  # validate accepted it: a rank raising is a finding
                bad = [f"validate accepts it but the run raised {type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}"]
                tally["raised"] += 1
            known = known_defects(cfg)
            raised = bad and bad[0].startswith("validate accepts")
            # a defect explains a raise only if it is one that raises
            known = [k for k in known if k[0] == bool(raised)] if bad else known
            if not bad:
                tally["agree"] += 1
                status = "agree" + (" (a listed defect did not show)" if known else "")
            else:
                tally["known" if known else "new"] += 1
                status = "KNOWN" if known else "NEW"
            print(f"[{i}] {status:6s} {name}")
            for line in bad:
                print(f"        {line}")
            for _, reason in known if bad else []:
                print(f"        known: {reason[:110]}")
            sys.stdout.flush()
    finally:
        for c in clusters.values():
            c.close()
    print(f"sweep n={len(configs)} seed={args.seed}{' (all-pairs)' if args.pairwise else ''}: {tally['refused']} refused by validate, "
          f"{tally['agree']} agree, {tally['known']} disagree with a diagnosed defect, "
          f"{tally['new']} disagree otherwise ({tally['raised']} raised on the ranks), "
          f"{time.time() - start:.0f} s")
    return 1 if tally["new"] else 0


if __name__ == "__main__":
    sys.exit(main())
