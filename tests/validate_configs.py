"""Seeded generator of RunConfigs over every field the training job composes, for the
property "``validate`` accepts a config ⇔ the ranks run it" (tests/test_validate_property.py;
``python tests/validate_configs.py N SEED`` sweeps N configs and prints every disagreement).

Most draws are built to be plausible (degrees that multiply to the world size, batches that
divide) so that both sides of the property are reached; a few fields are then perturbed at
random, so refusals are exercised too."""
from __future__ import annotations

import dataclasses
import random

from labkit.config import ModelConfig, RunConfig, preset

#: small shapes: a 4-layer GQA model (pipelines with 2 stages per rank), top-1 MoE with
#: capacity, the presets tiny / tiny-moe and the ViT, with its class token and mean-pooled
#: (no class token: the only ViT that context or sequence parallelism may split)
MODELS = (
    "tiny",
    "tiny-moe",
    "vit-digits",
    dataclasses.replace(preset("vit-digits"), pool="mean", name="vit-digits-mean"),
    GQA4 := ModelConfig(n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, seq_len=16,
                        tie_embeddings=False, name="gqa4"),
    ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, n_experts=4, top_k=1,
                capacity_factor=1.0, name="moe-top1"),
)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
POLICIES = ("none", "full", "every", "selective")
FIXED = dict(steps=1, measure_memory=False, count_flops=False, timeout_s=60)


def _factor(rng: random.Random, n: int, k: int) -> list:
    """A random ordered factorisation of ``n`` into ``k`` positive factors."""
    out = [1] * k
    for p in (2, 3):
        while n % p == 0:
            out[rng.randrange(k)] *= p
            n //= p
    out[0] *= n
    return out


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw(rng: random.Random, max_world: int = 4) -> RunConfig:
    """One config for at most ``max_world`` ranks."""
    ws = rng.randint(1, max_world)
    model = rng.choice(MODELS)
    vit = (preset(model) if isinstance(model, str) else model).kind == "vit"
    dp, tp, pp, cp = [ws, 1, 1, 1] if vit and rng.random() < 0.8 else _factor(rng, ws, 4)
    kw: dict = dict(model=model, parallel=dict(dp=dp, tp=tp, pp=pp, cp=cp),
                    dataset="digits" if vit else "text")
    if not vit and rng.random() < 0.5:
        kw["parallel"]["ep"] = rng.choice(_divisors(dp * cp))
    z = kw["zero_stage"] = rng.choice((0, 0, 1, 2, 3, 3))
    if z and rng.random() < 0.3:
        kw["hsdp_replicas"] = rng.choice(_divisors(dp))
    if z == 3:
        kw["prefetch"], kw["keep_last"] = rng.random() < 0.7, rng.random() < 0.7
    if z == 0 and dp * cp > 1:
        kw["dp_mode"] = rng.choice(("ddp", "ddp", "naive"))
        kw["find_unused"] = rng.random() < 0.3
        if kw["dp_mode"] == "ddp" and rng.random() < 0.3:
            kw["bucket_mb"] = 0.01
    if tp > 1:
        kw["sequence_parallel"] = rng.random() < 0.5
    if cp > 1:
        kw["cp_method"] = rng.choice(("ring", "ulysses", "allgather"))
        kw["cp_zigzag"] = rng.random() < 0.5
    kw["global_batch"] = dp * rng.choice((1, 2, 4))
    local = kw["global_batch"] // dp
    if rng.random() < 0.4:
        kw["micro_batch"] = rng.choice(_divisors(local))
    if pp > 1:
        kw["schedule"] = rng.choice(SCHEDULES)
        if rng.random() < 0.3:
            kw["microbatches"] = rng.choice((1, 2, 4))
        if kw["schedule"] == "interleaved" and rng.random() < 0.5:
            kw["virtual_stages"] = 2
        if kw["schedule"] == "dualpipe-v" and not vit and rng.random() < 0.7:
            # DualPipeV runs 2 stages per rank on M >= 2P microbatches, without ZeRO: mostly
            # draw the 4-layer model, enough rows and no sharding (the perturbations below
            # still reach the refusals)
            kw.update(model=GQA4, global_batch=dp * 2 * pp, microbatches=2 * pp, zero_stage=0)
            for k in ("micro_batch", "hsdp_replicas", "prefetch", "keep_last"):
                kw.pop(k, None)
    kw["checkpoint"] = rng.choice(POLICIES + ("none", "none"))
    if kw["checkpoint"] == "every":
        kw["checkpoint_every"] = rng.choice((1, 2))
    kw["precision"] = rng.choice(("fp32", "fp32", "bf16"))
    if rng.random() < 0.15:
        kw["impl"] = "torch"
        kw["checkpoint"], kw["precision"] = "none", "fp32"
        kw.pop("checkpoint_every", None)
    for _ in range(rng.choice((0, 0, 0, 1, 1, 2))):  # perturb: reach the refusals
        name, values = rng.choice(PERTURB)
        kw[name] = rng.choice(values)
    par = kw.pop("parallel")
    return RunConfig(**FIXED, **kw).replace(**par)


PERTURB = (("zero_stage", (0, 1, 2, 3)), ("checkpoint", POLICIES), ("checkpoint_every", (1, 2, 3)),
           ("precision", ("fp32", "bf16")), ("impl", ("labkit", "torch")),
           ("sequence_parallel", (True, False)), ("cp_zigzag", (True, False)),
           ("cp_method", ("ring", "ulysses", "allgather")), ("schedule", SCHEDULES),
           ("microbatches", (None, 1, 2, 3)), ("virtual_stages", (None, 1, 2, 3)),
           ("micro_batch", (None, 1, 2, 3)), ("global_batch", (1, 2, 4, 6, 8)),
           ("hsdp_replicas", (1, 2)), ("find_unused", (True, False)),
           ("dp_mode", ("ddp", "naive")), ("model", MODELS), ("dataset", ("text", "digits")))


def describe(cfg: RunConfig) -> str:
    """The fields that differ from the defaults (and from :data:`FIXED`)."""
    base = RunConfig(**FIXED)
    p = cfg.parallel
    out = [f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep}"]
    for name in RunConfig.__dataclass_fields__:
        if name in ("parallel",):
            continue
        v = getattr(cfg, name)
        if v != getattr(base, name):
            out.append(f"{name}={getattr(v, 'name', v)!r}")
    return " ".join(out)


def sweep(cluster, n: int, seed: int, accepted_only_max: int | None = None):
    """Draw ``n`` configs; yield ``(cfg, verdict, detail)`` with verdict ``"refused"``,
    ``"ran"`` or ``"FAILED"`` (validate accepted, a rank raised or hung)."""
    rng = random.Random(seed)
    ran = 0
    for _ in range(n):
        cfg = draw(rng, cluster.world_size)
        try:
            cfg.validate(cluster.world_size)
        except ValueError as e:
            yield cfg, "refused", str(e)
            continue
        if accepted_only_max is not None and ran >= accepted_only_max:
            continue
        ran += 1
        try:
            cluster.run("labkit.jobs:train", cfg)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            yield cfg, "FAILED", f"{type(e).__name__}: {str(e)[-600:]}"
        else:
            yield cfg, "ran", ""


if __name__ == "__main__":
    import sys
    import time

    import labkit

    n, seed = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
    c = labkit.Cluster(4, backend="gloo", device="cpu")
    counts: dict = {}
    t0 = time.perf_counter()
    try:
        for cfg, verdict, detail in sweep(c, n, seed):
            counts[verdict] = counts.get(verdict, 0) + 1
            if verdict == "FAILED":
                print(f"FAILED {describe(cfg)}\n    {detail.strip().splitlines()[-1]}",
                      flush=True)
    finally:
        c.close()
    print(f"{n} configs, seed {seed}: {counts} in {time.perf_counter() - t0:.0f} s")
