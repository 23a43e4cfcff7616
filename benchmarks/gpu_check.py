"""The CUDA path, on a machine with a GPU: NCCL cluster, parity with the CPU reference,
MFU against the datasheet peak, and the allocator's peak beside the tensor accounting.

Skips (exit 0) where no GPU is visible. Prints ``RESULT`` lines.
"""
from __future__ import annotations

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    import labkit as lk
    from labkit.train import reference

    n = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {n} x {torch.cuda.get_device_name(0)}")
    with lk.Cluster(world_size=n, backend="auto") as cluster:
        print(cluster)
        hello = cluster.run(lk.jobs.hello)
        print("hello:", hello.outputs[0])
        assert cluster.backend == "nccl" and hello.outputs[0]["device"].startswith("cuda")

        cfg = lk.RunConfig(model="tiny", steps=4, global_batch=8, return_state=True).replace(dp=n)
        r = cluster.run(lk.jobs.train, cfg)
        ref = reference(cfg)
        d_loss = max(abs(a - b) for a, b in zip(r.losses, ref["losses"]))
        d_par = max((t - ref["state"][name]).abs().max().item()
                    for o in r.outputs for name, t in o["state"].items())
        print(f"RESULT cuda_vs_cpu_tiny_max_loss_diff {d_loss:.2e}")
        print(f"RESULT cuda_vs_cpu_tiny_max_param_diff {d_par:.2e}")

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
                  f"{mem['allocator_peak']:,} B")
            print(f"RESULT cuda_mfu_{model}_zero{cfg.zero_stage} {m['mfu']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
