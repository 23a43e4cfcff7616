"""MFU of labkit's training job against a plain PyTorch loop, on one GPU.

The model is the issue's 0.87B GPT (``L=16, H=2048, A=16, KV=8, V=32000, S=2048``),
micro-batch 8, one GPU. Two programs train it for the same steps:

* **labkit**: ``labkit.jobs.train`` on ``Cluster(1)`` (NCCL, one rank) with
  ``precision="bf16"`` (bf16 autocast over fp32 weights, fused AdamW) and, in the compiled
  row, ``compile=True`` (each block through ``torch.compile``), traced and measured as
  always; its MFU is its own report (counted FLOPs / step time / the GPU's bf16 peak);
* **plain**: the same model, batches and optimizer in a bare loop — bf16 autocast, fused
  AdamW, optionally ``torch.compile`` of each block — timed with CUDA events, its MFU
  computed from the same counted FLOPs and peak.

Prints both MFUs per mode (eager, compiled) and the ratio labkit / plain; the goal is
labkit >= 0.95x the plain compiled loop. ``--smoke`` runs a tiny model on whatever device
is there (CPU included) to check the script itself. Prints ``RESULT`` lines.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

GOAL = 0.95


def model_config(smoke: bool):
    from labkit.config import ModelConfig

    if smoke:
        return ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256,
                           seq_len=64, tie_embeddings=False, name="smoke")
    return ModelConfig(n_layers=16, d_model=2048, n_heads=16, n_kv_heads=8, vocab_size=32000,
                       seq_len=2048, tie_embeddings=False, name="gpt-0.87b")


def labkit_mfu(mc, batch: int, steps: int, compile_: bool) -> dict:
    import labkit as lk
    from labkit.config import RunConfig

    cfg = RunConfig(model=mc, steps=steps, global_batch=batch, micro_batch=batch,
                    precision="bf16", compile=compile_, measure_memory=True, timeout_s=1800)
    with lk.Cluster(world_size=1, backend="auto") as cluster:
        m = cluster.run(lk.jobs.train, cfg).metrics[0]
    return {"mfu": m["mfu"], "step_s": m["step_time_s"], "flops": m["flops_per_step"],
            "peak": m["peak_flops"], "allocator_peak": (m.get("memory") or {}).get(
                "allocator_peak")}


def plain_mfu(mc, batch: int, steps: int, compile_: bool, flops: float, peak: float) -> dict:
    from labkit.models import build_model
    from labkit.models.data import text_batch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(mc, device=dev, seed=0)
    if compile_:
        for block in model.layers:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if dev.type == "cuda"
                                                            else {}))
    times = []
    for s in range(steps):
        x, y = text_batch(s, batch, mc.seq_len, 0)
        x, y = x.to(dev), y.to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[2:] or times)  # compile and allocation in the first steps
    return {"mfu": flops / (step * peak) if peak else None, "step_s": step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, any device")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: run with --smoke to check the script on CPU")
        return 0
    mc = model_config(args.smoke)
    from labkit.models.gpt import count_params

    print(f"torch {torch.__version__} · {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}"
          f" · model {mc.name}: {count_params(mc) / 1e9:.3f}B params, S={mc.seq_len}, "
          f"micro-batch {args.batch}")
    rows = []
    for compile_ in (False, True):
        ours = labkit_mfu(mc, args.batch, args.steps, compile_)
        theirs = plain_mfu(mc, args.batch, args.steps, compile_, ours["flops"], ours["peak"])
        ratio = ours["mfu"] / theirs["mfu"] if ours["mfu"] and theirs["mfu"] else None
        mode = "compiled" if compile_ else "eager"
        rows.append((mode, ours, theirs, ratio))
        print(f"{mode:>8}: labkit MFU {100 * (ours['mfu'] or 0):.1f} % "
              f"({1e3 * ours['step_s']:.1f} ms/step) · plain loop MFU "
              f"{100 * (theirs['mfu'] or 0):.1f} % ({1e3 * theirs['step_s']:.1f} ms/step) · "
              f"ratio {ratio if ratio is None else f'{ratio:.3f}'}"
              + (f" · allocator peak {ours['allocator_peak'] / 2**30:.1f} GiB"
                 if ours["allocator_peak"] else ""))
        print(f"RESULT gpu_mfu_labkit_{mode} {ours['mfu']}")
        print(f"RESULT gpu_mfu_plain_{mode} {theirs['mfu']}")
        print(f"RESULT gpu_mfu_ratio_{mode} {ratio}")
    final = rows[-1][3]
    print(f"goal labkit >= {GOAL} x plain compiled -> "
          f"{'OK' if final is not None and final >= GOAL else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
