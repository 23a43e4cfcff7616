"""Every field of every config either takes effect or is refused before launch.

A field that a job silently ignores is how a lab prints a number for a setting it never
ran (ZeRO with ``checkpoint="full"`` once counted recomputation it never did). For each job
and its config class, this walks every field: set to a non-default value in each base
composition, the config must either be refused by ``validate`` (a ``ValueError``) or change
what the run does — its losses, its metrics (clock readings aside), or the order, names and
bytes of its trace events. And each field must take effect somewhere: in the composition
``EFFECT`` names for it. A new field without an entry here fails the test.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from labkit import jobs
from labkit.config import ModelConfig, RunConfig

pytestmark = pytest.mark.distributed

BASE = RunConfig(steps=2, global_batch=8, timeout_s=120)
DEEP = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, name="deep4")
DEEPER = ModelConfig(n_layers=8, d_model=32, n_heads=4, seq_len=16, name="deep8")
#: base compositions every field is tried in (2 ranks)
COMPOSITIONS = {"dp1": {}, "dp2": dict(dp=2), "zero3": dict(dp=2, zero_stage=3),
                "pp2": dict(pp=2), "tp2": dict(tp=2), "cp2": dict(cp=2)}
#: the non-default value each field is set to
VALUES = {
    "model": "small", "parallel": None, "steps": 3, "global_batch": 4, "micro_batch": 1,
    "lr": 1e-2, "weight_decay": 0.1, "adam_eps": 1e-3, "seed": 1, "dataset": "digits", "zero_stage": 1,
    "hsdp_replicas": 2, "prefetch": False, "keep_last": False, "dp_mode": "naive",
    "bucket_mb": 0.01, "find_unused": True, "schedule": "gpipe", "microbatches": 2,
    "virtual_stages": 4, "sequence_parallel": True, "cp_method": "ulysses",
    "cp_zigzag": False, "checkpoint": "full", "checkpoint_every": 2, "precision": "bf16",
    "compile": True, "impl": "torch", "measure_memory": False, "count_flops": False,
    "timeout_s": 5.0, "return_state": True, "return_grads": True,
    "fault": "bitflip@1:rank1", "watchdog_s": 30.0, "straggler_s": 5.0, "fingerprint_every": 1,
    "save_dir": "/nonexistent/labkit-snapshots", "save_every": 1, "resume": True,
    "noise_scale": True,
}
#: where each field must take effect: (composition, extra fields)
EFFECT = {
    "model": ("dp1", {}), "steps": ("dp1", {}), "global_batch": ("dp1", {}),
    "micro_batch": ("dp2", {}), "lr": ("dp1", {}), "weight_decay": ("dp1", {}),
    "adam_eps": ("dp1", {}),
    "seed": ("dp1", {}),
    "zero_stage": ("dp2", {}), "hsdp_replicas": ("zero3", {}), "prefetch": ("zero3", {}),
    "keep_last": ("zero3", {}), "dp_mode": ("dp2", {}), "bucket_mb": ("dp2", {}),
    "schedule": ("pp2", {}), "sequence_parallel": ("tp2", {}),
    "cp_method": ("cp2", {}), "cp_zigzag": ("cp2", {}), "microbatches": ("pp2", dict(micro_batch=1)),
    "virtual_stages": ("pp2", dict(model=DEEPER, schedule="interleaved", microbatches=2)),
    "checkpoint": ("dp1", {}), "checkpoint_every": ("dp1", dict(checkpoint="every", model=DEEP)),
    "precision": ("dp2", {}), "compile": ("dp1", {}), "impl": ("dp2", {}),
    "measure_memory": ("dp1", {}), "count_flops": ("dp1", {}), "return_state": ("dp1", {}),
    "return_grads": ("dp1", {}),
    "noise_scale": ("dp2", {}),
    "fault": ("dp2", {}), "fingerprint_every": ("dp2", {}),
}
#: fields whose effect a run's result cannot show, and the test that shows it
ELSEWHERE = {
    "parallel": "the degrees: every composition here and tests/test_train.py",
    "dataset": "follows the model's kind (text for the GPT, digits for the ViT); a mismatch "
               "is refused (tests/test_config.py), the ViT trains in tests/test_dp.py",
    "find_unused": "tests/test_dp.py::test_unused_parameter_is_named_not_hung (the GPT "
                   "uses every parameter)",
    "timeout_s": "tests/test_cluster.py::test_timeout_restarts (a cluster-side deadline)",
    "watchdog_s": "tests/test_faults.py::test_faults_on_the_warm_cluster (a cluster-side "
                  "hang detector: a finished run never met it)",
    "straggler_s": "tests/test_faults.py::test_faults_on_the_warm_cluster (a cluster-side "
                   "live detector: reports, never changes the run)",
    "save_dir": "writes files, read back by tests/test_snapshot.py (the snapshot matrix)",
    "save_every": "tests/test_snapshot.py::test_save_every_and_write_then_rename",
    "resume": "tests/test_snapshot.py (resumed runs match the uninterrupted ones)",
}
CLOCK = {"step_time_s", "step_times", "mfu", "hfu", "peak_flops", "p2p_latency_s", "overlap",
         "reused"}  # what a warm rank took from its cache: the same run either way
#: fingerprint per configuration already run in this module (see :func:`_fingerprint`)
_RUNS: dict = {}


def fingerprint(result) -> tuple:
    """What a run did, without clock readings: losses, metrics, per-rank event order."""
    metrics = [{k: v for k, v in m.items() if k not in CLOCK} for m in result.metrics]
    per_rank = {r: [(e.name, e.cat, e.op, e.bytes_sent, e.args.get("stage"),
                     e.args.get("microbatch"))
                    for e in sorted(result.trace.filter(rank=r), key=lambda e: e.start)
                    if e.cat != "wait"]
                for r in result.trace.ranks}
    keys = [sorted(o) for o in result.outputs]
    return (tuple(round(x, 7) for x in result.losses), repr(metrics),
            repr({r: Counter(v) for r, v in per_rank.items()}), repr(per_rank), repr(keys))


def _fingerprint(cluster, cfg) -> tuple:
    """The fingerprint of ``cfg``'s run, run once per module: the walk below already runs
    the base and the changed configuration that most of ``test_each_field_takes_effect_
    somewhere`` compare, and a run is deterministic (both tests rely on that: a run that
    differed from itself would make every field look effective). ``timeout_s`` is left out
    of the key: it bounds a run and changes nothing a finished run did."""
    key = repr(dataclasses.replace(cfg, timeout_s=None))
    if key not in _RUNS:
        _RUNS[key] = fingerprint(cluster.run(jobs.train, cfg))
    return _RUNS[key]


def _outcome(cluster, cfg):
    """``"refused"`` or the run's fingerprint."""
    try:
        cfg.validate(cluster.world_size)
    except ValueError:
        return "refused"
    return _fingerprint(cluster, cfg)


def test_every_field_has_a_value_and_a_place_to_show():
    names = [f.name for f in dataclasses.fields(RunConfig)]
    assert set(names) == set(VALUES), set(names) ^ set(VALUES)
    for n in names:
        assert (n in EFFECT) != (n in ELSEWHERE), n
        assert VALUES[n] != getattr(BASE, n) or n == "parallel", n


@pytest.mark.parametrize("comp", list(COMPOSITIONS))
def test_each_field_takes_effect_or_is_refused(cluster2, comp):
    base = BASE.replace(**COMPOSITIONS[comp])
    baseline = _fingerprint(cluster2, base)
    silent = []
    for f in dataclasses.fields(RunConfig):
        if f.name in ELSEWHERE:
            continue
        outcome = _outcome(cluster2, dataclasses.replace(base, **{f.name: VALUES[f.name]}))
        if outcome != "refused" and outcome == baseline:
            silent.append(f.name)
    assert not silent, f"{comp}: fields accepted and ignored: {silent}"


@pytest.mark.parametrize("name", sorted(EFFECT))
def test_each_field_takes_effect_somewhere(cluster2, name):
    comp, extra = EFFECT[name]
    # compiling the blocks with inductor takes minutes on two shared cores
    base = BASE.replace(**COMPOSITIONS[comp], **extra, timeout_s=900 if name == "compile"
                        else BASE.timeout_s)
    changed = base.replace(**{name: VALUES[name]})
    changed.validate(2)  # must run here
    assert _fingerprint(cluster2, changed) != _fingerprint(cluster2, base)
