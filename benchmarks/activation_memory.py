"""Activation memory per layer, by part, beside C18's count; and the step time it costs.

Two measurements of the training job's own layers (labkit.train.build.build_rank, one
microbatch forward under the job's precision), under fake tensors and a fake process group
(equal to the real job's bytes: tests/test_layer_activations.py):

* the tiny model, TP2 + SP, bf16 (autocast), rank 0 of 2;
* Llama 3 405B's layer on a TP8 + SP rank, bf16 weights (ZeRO 1), sequence 8,192, microbatch 1.

Each prints bytes per part of one layer (attention norm, attention, MLP norm, MLP) beside
C18's count for the same shapes (labkit.parallel.tensor.activations.megatron_block_terms) and
labkit's named extra terms. The counting code lives in this script, so the same count runs
against another checkout's labkit (``PYTHONPATH=/work/main``: the code before a change).

Step time: the real job (2 CPU ranks, gloo), tiny model TP2 + SP bf16, median of the steady
steps of the slowest rank. ``--compare DIR`` runs this script's time measurement alternately
with DIR's labkit and this checkout's (``--repeats`` each) and prints the ratio of medians.

    python benchmarks/activation_memory.py [--memory] [--time] [--compare /work/main]

Prints ``RESULT activation_memory ...`` and ``RESULT step_time ... ratio=...``.

Measured (2-core machine shared by several jobs, load 8-25): one layer of the tiny model
(TP2+SP, bf16 autocast, rank 0) kept 576,512 B before (1.75x C18's count for its shapes) and
363,520 B after (C18's count plus the named terms: 1/rms per norm, the fp32 residual stream
under autocast); Llama 3 405B's layer on a TP8+SP rank 1,342,709,760 B before (2.09x) and
642,260,992 B after (C18's count plus 8 KiB of 1/rms). Step time after/before, three runs
of ``--compare /work/main``: 0.50 and 0.64 (8 runs a side, load 8-25), 1.29 (4 runs a side,
load 2-9); this checkout against itself without the job's re-gathers: 0.72. The machine's
noise (other jobs) is larger than the effect; the re-gathers add 5 all-gathers per step
(2 per block and the head's), which a latency-bound tiny model on gloo may feel.
benchmarks/sp_step_time.py is the fairer comparison (warm clusters of both checkouts taking
turns A B B A, one thread per rank, wall and CPU time, the load beside them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import warnings
from dataclasses import replace

import torch

PARTS = ("attn_norm", "attn", "mlp_norm", "mlp")
MiB = 2 ** 20
_WEIGHT_PATH = ("ToCopyBackward", "ViewBackward", "SliceBackward", "AliasBackward",
                "TBackward", "TransposeBackward", "IdentityFwdAllReduceBwdBackward",
                "SplitBackward", "SplitWithSizesBackward", "AsStridedBackward")


def _from_weights(t) -> bool:
    node = t.grad_fn
    for _ in range(8):
        name = type(node).__name__ if node is not None else ""
        if name == "AccumulateGrad":
            return True
        nexts = [n for n, _ in node.next_functions if n is not None] if node is not None else []
        if not name.startswith(_WEIGHT_PATH) or len(nexts) != 1:
            return False
        node = nexts[0]
    return False


def saved_by_part(stage, x, exclude) -> dict:
    """``{layer: {part: bytes}}`` saved for backward during ``stage(x)`` (the rule of
    labkit.parallel.tensor.activations.measure_block_activations, copied so that it runs
    against any checkout)."""
    skip = {t.untyped_storage()._cdata for m in (stage, exclude)
            for t in list(m.parameters()) + list(m.buffers())}
    cur, seen, out = [None, "other"], set(), {}
    half = stage.layers[0].attn.head_dim // 2

    def pack(t):
        st = t.untyped_storage()
        if st._cdata in skip or st._cdata in seen or _from_weights(t):
            return t
        seen.add(st._cdata)
        part = cur[1]
        if t.dtype == torch.float32 and t.dim() in (2, 3) and t.shape[-1] == half \
                and (t.dim() == 2 or t.shape[1] == 1):
            part = "rotary tables"
        row = out.setdefault(cur[0], {})
        row[part] = row.get(part, 0) + st.nbytes()
        return t

    def setter(i, part):
        return lambda *a: cur.__setitem__(slice(None), [i, part])

    hs = []
    for i, b in enumerate(stage.layers):
        hs += [b.register_forward_pre_hook(setter(i, "other")),
               b.register_forward_hook(setter(None, "other"))]
        for name in PARTS:
            hs += [getattr(b, name).register_forward_pre_hook(setter(i, name)),
                   getattr(b, name).register_forward_hook(setter(i, "other"))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stage(x)
        del y
    finally:
        for h in hs:
            h.remove()
    return out


def fake_rank_layers(cfg, rank: int) -> dict:
    """The job's stages of ``rank`` built and run one microbatch forward under fake tensors
    and a fake process group (labkit.measure.fake_rank's stand-ins)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.measure.fake_rank import _context, _fake_mode
    from labkit.train.build import build_rank
    from labkit.train.data import rank_batch

    world = cfg.parallel.world_size
    if cfg.dataset == "text":
        from labkit.models.data import text_corpus

        text_corpus("train")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with warnings.catch_warnings(), _fake_mode():
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            ctx = _context(rank, world)
            mg = ctx.mesh_groups(cfg.mesh)
            setup = build_rank(ctx, cfg, mg)
            stage = setup.stages[0]
            x, _ = rank_batch(cfg, 0, mg.index("dp"), setup.device, mg.index("cp"))
            with setup.autocast():
                return saved_by_part(stage, x[:cfg.micro], setup.memory_module)
    finally:
        dist.destroy_process_group()


def configs() -> dict:
    from labkit.config import ParallelConfig, RunConfig, preset

    tiny = RunConfig(model="tiny", parallel=ParallelConfig(tp=2), global_batch=4, steps=1,
                     precision="bf16", sequence_parallel=True, count_flops=False)
    big = RunConfig(model=replace(preset("llama3-405b"), n_layers=2),
                    parallel=ParallelConfig(tp=8, dp=2), global_batch=2, micro_batch=1, steps=1,
                    precision="bf16", zero_stage=1, sequence_parallel=True, count_flops=False)
    return {"tiny TP2+SP bf16 (rank 0)": (tiny, 0), "Llama 3 405B TP8+SP bf16 (rank 0)": (big, 0)}


def memory() -> None:
    try:
        from labkit.measure.layer_activations import predicted_layer_activations
    except ImportError:  # a checkout before the per-layer count
        predicted_layer_activations = None
    for name, (cfg, rank) in configs().items():
        got = fake_rank_layers(cfg, rank)
        layer = got[1]  # not the first: the per-forward rotary rows are charged to layer 0
        want = predicted_layer_activations(cfg) if predicted_layer_activations else None
        mega = None
        if want is None:  # C18's count for these shapes, from the planner
            from labkit.plan.activations import layer_activation_bytes
            from labkit.plan.models import plan_model

            mc, p = cfg.model_config, cfg.parallel
            mega = layer_activation_bytes(plan_model(mc), cfg.micro, mc.seq_len // p.cp,
                                          mc.seq_len, p.tp, cfg.sequence_parallel)["total"]
        print(f"\n== {name}: one layer, bytes by part")
        print(f"{'part':<12}{'measured':>16}{'C18 count':>16}{'+ named terms':>16}")
        for part in PARTS + ("other",):
            m = layer.get(part, 0)
            c = want["megatron"].get(part, 0) if want else float("nan")
            t = want["total"].get(part, 0) if want else float("nan")
            print(f"{part:<12}{m:>16,}{c:>16,.0f}{t:>16,.0f}")
        total = sum(layer.values())
        ref = sum(want["megatron"].values()) if want else mega
        print(f"{'layer':<12}{total:>16,}{ref:>16,.0f}   measured / C18 count = {total / ref:.3f}")
        if want:
            for term, parts in want["adjustments"].items():
                print(f"  named: {term}: {sum(parts.values()):,} B")
        print(f"RESULT activation_memory case={name.split(' (')[0].replace(' ', '_')} "
              f"layer_bytes={total} c18_bytes={ref:.0f} ratio={total / ref:.4f}")


def step_times(steps: int, repeats: int) -> list:
    import labkit
    from labkit import jobs

    cfg, _ = configs()["tiny TP2+SP bf16 (rank 0)"]
    cfg = replace(cfg, steps=steps, global_batch=8)
    out = []
    with labkit.Cluster(world_size=2, backend="gloo", device="cpu") as cluster:
        cluster.run(jobs.train, cfg)  # warm-up
        for _ in range(repeats):
            r = cluster.run(jobs.train, cfg)
            out.append(max(m["step_time_s"] for m in r.metrics))
    return out


def compare(other: str, repeats: int, steps: int) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mine = os.environ.get("PYTHONPATH", here)
    times: dict = {"before": [], "after": []}
    for _ in range(repeats):
        for label, path in (("before", other), ("after", mine), ("after", mine),
                            ("before", other)):
            env = dict(os.environ, PYTHONPATH=path)
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--time-json",
                                  "--steps", str(steps)], env=env, capture_output=True,
                                 text=True, check=True)
            times[label] += json.loads(res.stdout.strip().splitlines()[-1])
    b, a = statistics.median(times["before"]), statistics.median(times["after"])
    print(f"step time, tiny TP2+SP bf16, 2 ranks: before {b * 1e3:.2f} ms "
          f"({len(times['before'])} runs), after {a * 1e3:.2f} ms; after/before = {a / b:.3f}")
    print(f"RESULT step_time before_ms={b * 1e3:.3f} after_ms={a * 1e3:.3f} ratio={a / b:.4f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--time-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compare", metavar="DIR")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.time_json:
        print(json.dumps(step_times(a.steps, 2)))
        return
    if a.memory or not (a.time or a.compare):
        memory()
    if a.time:
        t = step_times(a.steps, a.repeats)
        print(f"RESULT step_time ms={statistics.median(t) * 1e3:.3f}")
    if a.compare:
        compare(a.compare, a.repeats, a.steps)


if __name__ == "__main__":
    main()
