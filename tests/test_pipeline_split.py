"""Uneven pipeline stages (:mod:`labkit.parallel.pipeline.split`): the default rule, explicit
per-stage counts, their refusals, and parity with one process when the stages differ in
depth."""
from __future__ import annotations

import pytest
from parity import assert_parity

from labkit import jobs
from labkit.config import ModelConfig, RunConfig
from labkit.models import build_model
from labkit.parallel.pipeline.split import layer_ranges, stage_layer_counts
from labkit.parallel.pipeline.stage import StageModule
from labkit.plan.layout import stage_layers

#: 3 thin layers: 2 stages of 1 and 2 layers; 5 layers: 4 stages of 1, 1, 2, 1
THREE = ModelConfig(n_layers=3, d_model=32, n_heads=4, seq_len=16, name="pp-three")
FIVE = ModelConfig(n_layers=5, d_model=32, n_heads=4, seq_len=16, name="pp-five")
FIVE_UNTIED = ModelConfig(n_layers=5, d_model=32, n_heads=4, seq_len=16, tie_embeddings=False,
                          name="pp-five-untied")
BASE = RunConfig(model=THREE, steps=2, global_batch=8, return_grads=True, return_state=True,
                 measure_memory=False, count_flops=False, adam_eps=1e-6)


def test_default_rule_takes_the_shortfall_from_the_ends():
    assert stage_layer_counts(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B
    assert stage_layer_counts(126, 14) == [9] * 14
    assert stage_layer_counts(3, 2) == [1, 2]
    assert stage_layer_counts(5, 4) == [1, 1, 2, 1]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]
    assert stage_layer_counts(7, 7) == [1] * 7
    for n_layers in range(1, 40):
        for n in range(1, n_layers + 1):
            c = stage_layer_counts(n_layers, n)
            assert sum(c) == n_layers and max(c) - min(c) <= 1 and min(c) >= 1, (n_layers, n)
            assert stage_layers(n_layers, n) == c  # the planner's split is labkit's


def test_ranges_are_contiguous_and_cover_every_layer():
    r = layer_ranges(126, 16)
    assert r[0] == range(0, 7) and r[1] == range(7, 15) and r[-1] == range(119, 126)
    assert [i for x in r for i in x] == list(range(126))
    assert layer_ranges(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]


@pytest.mark.parametrize("args,match", [
    ((3, 2, [1, 1]), r"stage_layers \[1, 1\] sum to 2, not n_layers=3"),
    ((3, 2, [3]), r"stage_layers has 1 entries for n_stages=2 stages: \[3\]"),
    ((3, 2, [0, 3]), r"stage_layers entries must be positive ints .* got 0 in \[0, 3\]"),
    ((3, 2, [1.5, 1.5]), r"got 1.5 in \[1.5, 1.5\]"),
    ((2, 3, None), r"n_stages=3 stages but n_layers=2: more stages than layers"),
    ((0, 1, None), r"n_layers must be a positive int, got 0"),
    ((4, True, None), r"n_stages must be a positive int, got True"),
])
def test_bad_counts_raise_naming_the_field_and_numbers(args, match):
    with pytest.raises(ValueError, match=match):
        stage_layer_counts(*args)


def test_stage_module_takes_explicit_counts():
    gpt = build_model(FIVE, seed=0)
    stages = [StageModule(gpt, s, 3, stage_layers=[1, 3, 1]) for s in range(3)]
    assert [m.layer_ids for m in stages] == [[0], [1, 2, 3], [4]]
    assert stages[1].layers[0] is gpt.layers[1] and stages[1].full_name("layers.2.x") == \
        "layers.3.x"
    assert [m.layer_ids for m in (StageModule(gpt, s, 4) for s in range(4))] == \
        [[0], [1], [2, 3], [4]]
    with pytest.raises(ValueError, match=r"sum to 4, not n_layers=5"):
        StageModule(gpt, 0, 3, stage_layers=[1, 2, 1])


def test_validation_accepts_uneven_stages_and_bounds_checkpoint_every_by_the_smallest():
    BASE.replace(pp=2).validate(2)
    BASE.replace(model=FIVE, pp=2, schedule="interleaved").validate(2)
    with pytest.raises(ValueError, match=r"checkpoint_every=2 must satisfy 1 <= C <= the 1 "
                                         r"blocks of a stage \(the smallest of \[1, 2\]"):
        BASE.replace(pp=2, checkpoint="every", checkpoint_every=2).validate(2)
    with pytest.raises(ValueError, match=r"pp x virtual_stages = 2 x 2 = 4 stages but the "
                                         r"model has n_layers=3"):
        BASE.replace(pp=2, schedule="interleaved").validate(2)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_uneven_two_stages_equal_one_process_on_every_rank(cluster2, schedule):
    """3 layers on 2 ranks (1 and 2 layers): losses, every rank's first-step gradients and
    final parameters equal one process; each rank holds exactly its stage's layers."""
    cfg = BASE.replace(pp=2, microbatches=4, schedule=schedule)
    r = cluster2.run(jobs.train, cfg)
    assert_parity(r, cfg)
    held = [sorted({k.split(".")[1] for k in o["state"] if k.startswith("layers.")})
            for o in r.outputs]
    assert held == [["0"], ["1", "2"]]


@pytest.mark.distributed
@pytest.mark.parametrize("schedule,model", [("interleaved", FIVE), ("zb-v", FIVE_UNTIED)])
def test_uneven_virtual_stages_equal_one_process(cluster2, schedule, model):
    """5 layers on 2 ranks x 2 stages (1, 1, 2, 1 layers), the interleaved and the V-shaped
    placement: parity on every rank."""
    cfg = BASE.replace(model=model, pp=2, microbatches=4, schedule=schedule)
    assert_parity(cluster2.run(jobs.train, cfg), cfg)
