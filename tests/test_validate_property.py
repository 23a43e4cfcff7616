"""``validate`` accepts a config ⇔ the ranks run it, as a property over generated configs.

Configs come from the seeded generator in tests/validate_configs.py (every field the job
composes: degrees, ZeRO/HSDP, SP, CP method and zigzag, schedules, microbatches, virtual
stages, checkpoint policies, precision, impl, models dense/MoE/GQA/ViT, batches, DP mode).
An accepted config runs one step on the warm 4-rank cluster (world sizes 1-4); a refused one
must be refused with a ``ValueError`` that names a field. ``python tests/validate_configs.py
N SEED`` runs a larger sweep and prints every disagreement."""
from __future__ import annotations

import dataclasses
import random
import re

import pytest
from validate_configs import FIXED, MODELS, describe, draw

from labkit.config import ModelConfig, ParallelConfig, RunConfig

pytestmark = pytest.mark.distributed

SEED, RUNS = 2024, 40
FIELDS = {f.name for cls in (RunConfig, ParallelConfig, ModelConfig)
          for f in dataclasses.fields(cls)} | {"kv heads", "ffn_dim", "head_dim", "n_stages"}
MOE_TOP1 = next(m for m in MODELS if getattr(m, "name", "") == "moe-top1")

#: configs the ranks once refused or crashed on after validate accepted them
ONCE_CRASHED_NOW_RUN = [
    # images (fp32) met ZeRO's bf16 flat parameters: the batch is now cast as autocast would
    dict(model="vit-digits", dataset="digits", dp=2, zero_stage=1, precision="bf16"),
    # the zero-bubble W pass assigned a bf16 dW to an fp32 weight under autocast
    dict(pp=2, schedule="zb-h1", precision="bf16"),
    # the experts' fp32 weights (outside ZeRO's bf16 units) met bf16 tokens: they now compute
    # in the tokens' dtype, as autocast would
    dict(model=MOE_TOP1, dp=2, ep=2, zero_stage=2, precision="bf16"),
]
ONCE_CRASHED_NOW_REFUSED = [
    (dict(dp=2, zero_stage=3, checkpoint="every", checkpoint_every=2),
     "checkpoint_every=2"),
    (dict(dp=2, zero_stage=3, hsdp_replicas=2, impl="torch"), "hsdp_replicas=2"),
    # byte-level text indexed a 37-row embedding past its end on every rank
    (dict(model=ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=37)),
     "vocab_size=37"),
]


def _names_a_field(message: str) -> bool:
    return any(re.search(rf"\b{re.escape(name)}\b", message) for name in FIELDS)


def test_refusals_name_a_field_and_run_nothing():
    """Every refusal of 250 generated configs is a ValueError naming a field."""
    rng = random.Random(SEED + 1)
    refused = 0
    for _ in range(250):
        cfg = draw(rng)
        try:
            cfg.validate(4)
        except ValueError as e:
            refused += 1
            assert _names_a_field(str(e)), (describe(cfg), str(e))
    assert 60 < refused < 220  # both sides of the property are reached


@pytest.mark.parametrize("kw,named", ONCE_CRASHED_NOW_REFUSED,
                         ids=[n for _, n in ONCE_CRASHED_NOW_REFUSED])
def test_what_the_ranks_refused_is_refused_before_launch(kw, named):
    cfg = RunConfig(**FIXED).replace(**kw)
    with pytest.raises(ValueError, match=re.escape(named)):
        cfg.validate(4)


#: values the generator draws too rarely for the first ``RUNS`` accepted configs to hold one
#: (the first accepted DualPipeV of seed 2024 is the 54th): the subset is topped up with the
#: first accepted config of each that it lacks
RARE = {
    "schedule='dualpipe-v'": lambda c: c.parallel.pp > 1 and c.schedule == "dualpipe-v",
    "ViT pool='mean'": lambda c: (c.model_config.kind == "vit"
                                  and c.model_config.pool == "mean"),
}
RARE_MAX_DRAWS = 2000  # validate only (no run): well under a second


def _accepted_subset() -> list:
    """The first ``RUNS`` accepted draws, then the first accepted draw of each :data:`RARE`
    value that they lack (searched up to ``RARE_MAX_DRAWS`` draws)."""
    rng = random.Random(SEED)
    subset: list = []
    for _ in range(RARE_MAX_DRAWS):
        lacking = [name for name, has in RARE.items() if not any(map(has, subset))]
        if len(subset) >= RUNS and not lacking:
            break
        cfg = draw(rng)
        try:
            cfg.validate(4)
        except ValueError:
            continue
        if len(subset) < RUNS or any(RARE[name](cfg) for name in lacking):
            subset.append(cfg)
    return subset


def test_the_subset_holds_the_rare_values():
    """A generator change cannot silently drop DualPipeV or the mean-pooled ViT from the
    configs that run, nor grow the run by more than the top-up."""
    subset = _accepted_subset()
    for name, has in RARE.items():
        assert any(map(has, subset)), f"no accepted {name} in {RARE_MAX_DRAWS} draws"
    assert RUNS <= len(subset) <= RUNS + len(RARE), len(subset)


def test_accepted_configs_run_one_step(cluster4):
    """The first ``RUNS`` accepted generated configs, topped up with the rare values of
    :data:`RARE`, (and those that once crashed) each run one step; every failure is listed
    with its config."""
    todo = [RunConfig(**FIXED).replace(**kw) for kw in ONCE_CRASHED_NOW_RUN]
    todo += _accepted_subset()
    failures = []
    for cfg in todo:
        try:
            r = cluster4.run("labkit.jobs:train", cfg)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            failures.append(f"{describe(cfg)}\n    {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[-1][:300]}")
            continue
        assert len(r.outputs) == cfg.parallel.world_size
    assert not failures, "validate accepted, the ranks failed:\n" + "\n".join(failures)
