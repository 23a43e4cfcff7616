"""Snapshots of the training state (labkit.snapshot): the save × load parity matrix, and the
bytes and seconds each rank writes and reads.

Part 1 — parity. For every save layout: the uninterrupted ``--steps``-step run, and a run
of half the steps that saves; then that snapshot is resumed in every load layout for the
other half. Printed per pair: the largest absolute difference of the final parameters (all
ranks' gathered state) and of the losses against the uninterrupted run — 0 expected in the
same layout, fp32 reduction order otherwise. The MoE layouts keep ``dp=2`` (their objective
depends on the token groups, dp × microbatch × cp), changing ep, tp and ZeRO.

Part 2 — I/O. ``--io-model`` (default ``small``) saved in each layout and loaded in another:
per rank, the bytes of its ``.distcp`` file and the save's seconds, the bytes it read (whole
stored chunks; DCP narrows them) from which files, and the load's seconds.

    python benchmarks/checkpoint_io.py [--quick] [--steps 4] [--io-model small]

Prints ``RESULT checkpoint_parity save=... load=... state_diff=... loss_diff=...`` and
``RESULT checkpoint_io layout=... rank=... written=... save_s=... read=... load_s=...``.
Timings are of this machine (2 shared cores, a local disk), not asserted anywhere.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import labkit
from labkit import jobs
from labkit.config import ModelConfig, RunConfig
from labkit.snapshot import folder

TINY = ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, name="snap-tiny")
MOE = ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, n_experts=4, top_k=2,
                  aux_loss_weight=0.01, name="snap-moe")
DENSE = {
    "dp4": dict(parallel=dict(dp=4)),
    "dp4-zero3": dict(parallel=dict(dp=4), zero_stage=3),
    "hsdp2x2-zero2": dict(parallel=dict(dp=4), zero_stage=2, hsdp_replicas=2),
    "dp2xtp2": dict(parallel=dict(dp=2, tp=2)),
    "dp2xtp2-zero1": dict(parallel=dict(dp=2, tp=2), zero_stage=1),
    "pp2xdp2-zero3": dict(parallel=dict(pp=2, dp=2), zero_stage=3),
    "pp2xtp2-sp": dict(parallel=dict(pp=2, tp=2), sequence_parallel=True),
    "dp2xcp2": dict(parallel=dict(dp=2, cp=2)),
    "pp2": dict(parallel=dict(pp=2)),
    "dp2-zero1": dict(parallel=dict(dp=2), zero_stage=1),
    "dp1": dict(parallel=dict(dp=1)),
    "fsdp2-torch": dict(parallel=dict(dp=2), zero_stage=3, impl="torch"),
}
MOE_LAYOUTS = {
    "moe-dp2xep2": dict(parallel=dict(dp=2, ep=2)),
    "moe-dp2": dict(parallel=dict(dp=2)),
    "moe-dp2xep2-zero3": dict(parallel=dict(dp=2, ep=2), zero_stage=3),
    "moe-dp2xtp2xep2": dict(parallel=dict(dp=2, tp=2, ep=2)),
}
QUICK = ["dp4", "dp2xtp2-zero1", "pp2xdp2-zero3", "dp1"]


def _state(result) -> dict:
    out: dict = {}
    for o in result.outputs:
        out.update(o["state"])
    return out


def parity(cluster, base: RunConfig, layouts: dict, root: Path) -> list:
    half = base.steps // 2
    rows = []
    for s, slay in layouts.items():
        cfg = base.replace(**slay)
        full = cluster.run(jobs.train, cfg)
        cluster.run(jobs.train, cfg.replace(steps=half, save_dir=str(root / s)))
        snap = folder.step_dir(root / s, half)
        ref = _state(full)
        for l, llay in layouts.items():
            res = cluster.run(jobs.train, base.replace(**llay, resume=str(snap)))
            got = _state(res)
            d = max((ref[k] - got[k]).abs().max().item() for k in ref)
            ld = max(abs(a - b) for a, b in zip(res.losses, full.losses[half:]))
            rows.append((s, l, d, ld))
            print(f"RESULT checkpoint_parity save={s} load={l} state_diff={d:.3e} "
                  f"loss_diff={ld:.3e}", flush=True)
    return rows


def io(cluster, model: str, layouts: list, root: Path) -> None:
    base = RunConfig(model=model, steps=2, global_batch=8, measure_memory=False,
                     count_flops=False, timeout_s=900)
    for i, name in enumerate(layouts):
        cfg = base.replace(**DENSE[name], save_dir=str(root / f"io-{name}"))
        saved = cluster.run(jobs.train, cfg)
        other = layouts[(i + 1) % len(layouts)]
        snap = folder.step_dir(root / f"io-{name}", 2)
        loaded = cluster.run(jobs.train, base.replace(**DENSE[other], steps=3,
                                                      resume=str(snap)))
        total = sum(m["snapshot"]["saved"][0]["bytes_written"] for m in saved.metrics)
        print(f"# {model}: saved as {name} ({total / 1e6:.2f} MB in all), loaded as {other}")
        for r, m in enumerate(saved.metrics):
            s = m["snapshot"]["saved"][0]
            print(f"RESULT checkpoint_io layout={name} rank={r} written={s['bytes_written']} "
                  f"save_s={s['seconds']:.3f}")
        for r, m in enumerate(loaded.metrics):
            x = m["snapshot"]["loaded"]
            files = ",".join(f"{f}:{b}" for f, b in sorted(x["reads"].items()))
            print(f"RESULT checkpoint_io layout={other}<-{name} rank={r} "
                  f"read={x['bytes_read']} load_s={x['seconds']:.3f} from={files}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--io-model", default="small")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = RunConfig(model=TINY, steps=args.steps, global_batch=8, adam_eps=1e-6,
                     measure_memory=False, count_flops=False, return_state=True,
                     timeout_s=900)
    dense = {k: DENSE[k] for k in QUICK} if args.quick else DENSE
    with tempfile.TemporaryDirectory() as tmp, \
            labkit.Cluster(4, backend="gloo", device="cpu") as cluster:
        root = Path(tmp)
        rows = parity(cluster, base, dense, root)
        if not args.quick:
            rows += parity(cluster, base.replace(model=MOE), MOE_LAYOUTS, root / "moe")
        same = [r for r in rows if r[0] == r[1]]
        other = [r for r in rows if r[0] != r[1]]
        print(f"# {len(rows)} pairs: same layout max diff "
              f"{max(max(r[2], r[3]) for r in same):.1e} (bitwise expected), other layouts "
              f"max state diff {max(r[2] for r in other):.1e}, loss diff "
              f"{max(r[3] for r in other):.1e}")
        io(cluster, args.io_model, QUICK[:3], root)


if __name__ == "__main__":
    main()
