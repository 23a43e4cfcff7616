"""The CUDA path, on a machine with a GPU, in one call: NCCL cluster; every composition that
fits on one GPU against the independent oracle (``tests/oracle``: losses, gradients before
the optimizer, final state, routing, FLOPs, bytes); MFU and the allocator's peak beside
the tensor accounting; then :mod:`gpu_mfu` (labkit's job vs a plain compiled bf16 loop).

Skips (exit 0) where no GPU is visible. ``--cpu-smoke`` runs the parity section on two CPU
ranks instead (to check this script without a GPU). Prints ``RESULT`` lines.

Run on the lent machine (torch is its own; put the checkout on the path)::

    PYTHONPATH=$PWD python benchmarks/gpu_check.py           # ~4-6 min on one H200
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

# one-GPU compositions: every knob that has a path at degree 1 (tp, cp, ep are 1 here; their
# degree-1 code paths are the ones a single GPU takes), each against the fp32 oracle
_BASE = dict(dp=1, tp=1, cp=1, pp=1, ep=1, zero_stage=0, hsdp_replicas=1,
             sequence_parallel=False, cp_method="ring", cp_zigzag=False, schedule="1f1b",
             virtual_stages=2, mlp="dense", tie_embeddings=True, gqa=False,
             precision="fp32", checkpoint="none", impl="labkit", accum=1)
CHOICES = [
    {},
    {"accum": 2, "gqa": True},
    {"checkpoint": "full"}, {"checkpoint": "selective"}, {"checkpoint": "every"},
    {"precision": "bf16"}, {"precision": "bf16", "checkpoint": "full", "accum": 2},
    {"mlp": "top1-cap"}, {"mlp": "top2"}, {"mlp": "top2", "precision": "bf16"},
    {"tie_embeddings": False, "gqa": True},
    {"impl": "torch"},
    {"zero_stage": 1, "precision": "bf16"}, {"zero_stage": 3}, {"zero_stage": 2, "accum": 2},
]
COMPILED = [{}, {"precision": "bf16"}]


def parity(cluster, n: int) -> int:
    """Runs each composition on ``n`` ranks of ``cluster``; prints one RESULT line each;
    returns the number that disagree with the oracle."""
    import labkit as lk
    from oracle.check import disagreements
    from oracle.matrix import accepted, compose, label

    failed = 0
    for choice, compiled in [(c, False) for c in CHOICES] + [(c, True) for c in COMPILED]:
        cfg = compose({**_BASE, **choice, "dp": n})
        if compiled:
            cfg = replace(cfg, compile=True)
        name = label(cfg) + (" compile" if compiled else "")
        if not accepted(cfg, n):
            print(f"RESULT parity {name}: refused by validate (skipped)")
            continue
        t0 = time.perf_counter()
        try:
            res = cluster.run(lk.jobs.train, cfg, timeout_s=600)
            bad = disagreements(res, cfg)
        except Exception as e:  # noqa: BLE001 - report and go on to the next composition
            bad = [f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"]
        failed += bool(bad)
        print(f"RESULT parity {name}: {'ok' if not bad else f'{len(bad)} disagreement(s)'} "
              f"({time.perf_counter() - t0:.1f} s)")
        for line in bad[:6]:
            print(f"    {line}")
    return failed


def mfu_and_memory(cluster, n: int) -> None:
    import labkit as lk

    for model, batch, zero in (("small", 32, 0), ("gpt2-124m", 8, 0), ("gpt2-124m", 8, 3)):
        cfg = lk.RunConfig(model=model, steps=5, global_batch=batch).replace(dp=n)
        if zero and n > 1:
            cfg = cfg.replace(zero_stage=zero)
        m = cluster.run(lk.jobs.train, cfg, timeout_s=300).metrics[0]
        mem = m["memory"]
        print(f"{model} ZeRO-{cfg.zero_stage}: step {1e3 * m['step_time_s']:.1f} ms, "
              f"flops/step counted {m['flops_per_step']:.3e} analytic "
              f"{m['flops_analytic']:.3e}, peak {m['peak_flops']:.3e} FLOP/s (fp32), "
              f"MFU {m['mfu']}")
        print(f"  memory model state {mem['model_state']} predicted {m['memory_predicted']}")
        print(f"  tracked peak {mem['peak_total']:,} B, allocator peak "
              f"{mem['allocator_peak']:,} B "
              f"({mem['allocator_peak'] / max(1, mem['peak_total']) - 1:+.2%})")
        print(f"RESULT cuda_mfu_{model}_zero{cfg.zero_stage} {m['mfu']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the parity section on 2 CPU ranks (checks the script)")
    ap.add_argument("--no-mfu", action="store_true", help="skip benchmarks/gpu_mfu.py")
    args = ap.parse_args()
    import labkit as lk

    if args.cpu_smoke:
        with lk.Cluster(world_size=2, backend="gloo") as cluster:
            return 1 if parity(cluster, 2) else 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    n = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {n} x {torch.cuda.get_device_name(0)}")
    with lk.Cluster(world_size=n, backend="auto") as cluster:
        print(cluster)
        hello = cluster.run(lk.jobs.hello)
        assert cluster.backend == "nccl" and hello.outputs[0]["device"].startswith("cuda")
        failed = parity(cluster, n)
        print(f"RESULT parity_failed {failed}")
        mfu_and_memory(cluster, n)
    if not args.no_mfu:
        import gpu_mfu

        sys.argv = [sys.argv[0]]
        gpu_mfu.main()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
