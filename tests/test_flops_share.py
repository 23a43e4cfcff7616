"""Per-rank FLOPs are the rank's share, and the CPU peak stays a ceiling.

The ground truth is torch's ``FlopCounterMode`` run here directly on one process's whole
model (the explicit ``attention="math"`` path, so no FLOP formula of labkit's is involved):
over the ``tp · cp · pp`` ranks of a replica the ranks' FLOPs add up to it, HFU adds exactly
the recomputed forward, the analytic count agrees, and a rank reports the same FLOPs in every
layout that gives it the same work. The peak tests inject the clock, the load and the
measured rates, so they do not depend on the machine.
"""
from __future__ import annotations

import functools
import itertools
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from labkit import jobs
from labkit.config import RunConfig
from labkit.models import build_model
from labkit.models.data import make_batch
from labkit.models.gpt import rope_slice

LAYOUTS = [dict(tp=t, cp=c, pp=p, dp=d) for t, c, p, d in itertools.product((1, 2), repeat=4)]


def torch_count(fn) -> int:
    mode = FlopCounterMode(display=False)
    with mode:
        fn()
    return int(mode.get_total_flops())


def reference(cfg) -> tuple[int, int, int]:
    """One replica's step in one process: (model FLOPs, FLOPs with every block under torch's
    non-reentrant checkpoint, forward FLOPs of the blocks)."""
    return _reference(cfg.model_config, cfg.local_batch, cfg.seed)


@functools.lru_cache(maxsize=None)
def _reference(mc, batch: int, seed: int) -> tuple[int, int, int]:
    model = build_model(mc, attention="math", seed=seed)
    x, y = make_batch(RunConfig(model=mc, global_batch=batch, seed=seed), 0)
    rope = rope_slice(model.rope_cos, model.rope_sin, x.shape[1])
    step = torch_count(lambda: model(x, y).backward())

    def checkpointed():
        h = model.tok_emb(x)
        for layer in model.layers:
            h = checkpoint(layer, h, rope, use_reentrant=False)
        logits = model.head(model.norm(h))
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()

    def blocks():
        with torch.no_grad():
            h = model.tok_emb(x)
            for layer in model.layers:
                h = layer(h, rope)

    return step, torch_count(checkpointed), torch_count(blocks)


class _Mg:
    def __init__(self, cfg, rank):
        self.mesh, self.rank = cfg.mesh, rank

    def index(self, axes):
        return self.mesh.index(self.rank, axes)


def rank_setups(cfg):
    """A stand-in for each rank's setup: the config, its stages and its mesh place."""
    sched = cfg.build_schedule() if cfg.parallel.pp > 1 else None
    for rank in range(cfg.parallel.world_size):
        mg = _Mg(cfg, rank)
        stages = sched.stages_of(mg.index("pp")) if sched else [0]
        yield rank, types.SimpleNamespace(cfg=cfg, mg=mg, stages={s: None for s in stages})


def per_rank(cfg, recompute=False):
    from labkit.train.flops import rank_flops, rank_flops_analytic

    ctx = types.SimpleNamespace(cache=_CACHE, device=torch.device("cpu"))
    return {r: (rank_flops(ctx, s, recompute), rank_flops_analytic(s))
            for r, s in rank_setups(cfg)}


_CACHE: dict = {}


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_ranks_of_a_replica_add_up_to_the_whole_model(model):
    """Every layout of tp, cp, pp, dp in {1, 2}: the ranks of a replica add up to one
    process's count of its batch; with full checkpointing, to the count with torch's
    checkpoint around every block; the analytic count equals the counted on every rank."""
    for lay in LAYOUTS:
        _check_layout(model, lay)


def _check_layout(model, lay):
    # four samples per replica in every layout: one reference per model
    cfg = RunConfig(model=model, global_batch=4 * lay["dp"], checkpoint="full").replace(**lay)
    cfg.validate(cfg.parallel.world_size)
    step, recomputing, fwd = reference(cfg)
    # torch stops recomputing a block once the tensors its backward saved are back (a dense
    # block's last matmul is not run again), so the extra is at most the blocks' forward
    assert step < recomputing <= step + fwd
    got, hw = per_rank(cfg), per_rank(cfg, recompute=True)
    replicas: dict = {}
    for rank in got:
        d = cfg.mesh.coords(rank)["dp_replicate"]
        replicas.setdefault(d, []).append(rank)
    assert len(replicas) == lay["dp"]
    for ranks in replicas.values():
        assert len(ranks) == lay["tp"] * lay["cp"] * lay["pp"]
        assert sum(got[r][0] for r in ranks) == step
        assert sum(hw[r][0] for r in ranks) == recomputing  # + the recomputed forward, exactly
    for rank, (counted, analytic) in got.items():
        assert analytic == counted, (rank, analytic, counted)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_the_same_work_gives_the_same_flops_in_every_layout(model):
    """Global batch 8 on 2 ranks: each rank does half the work whether the ranks split the
    batch (dp=2), the heads (tp=2) or the sequence (cp=2)."""
    base = RunConfig(model=model, global_batch=8)
    seen = {name: sorted(per_rank(base.replace(**{name: 2})).values())
            for name in ("dp", "tp", "cp")}
    assert seen["dp"] == seen["tp"] == seen["cp"], seen
    if model == "tiny":
        assert seen["tp"][0][0] == 213_909_504  # was 427,819,008: the whole replica's


@pytest.mark.distributed
def test_a_tp_job_reports_each_rank_its_share(cluster2):
    """The training job itself: dp=2 and tp=2 report the same FLOPs on every rank, and
    MFU ≤ HFU ≤ 100 % holds (or the metrics say why not)."""
    out = {}
    for name in ("dp", "tp"):
        cfg = RunConfig(global_batch=8, steps=1, measure_memory=False).replace(**{name: 2})
        out[name] = cluster2.run(jobs.train, cfg).metrics
    for name, metrics in out.items():
        for m in metrics:
            assert m["flops_per_step"] == m["flops_analytic"] == 213_909_504, (name, m)
            assert m["peak_age_s"] is not None and m["peak_conditions"]["ranks"] == 2
            if m["mfu_error"] is None:
                assert 0 < m["mfu"] <= m["hfu"] <= 1
            else:
                assert m["mfu"] is None and "> 100 %" in m["mfu_error"]


@pytest.mark.distributed
def test_an_n_d_job_adds_up_to_the_whole_model(cluster4):
    """tp=2 × cp=2 and tp=2 × pp=2 of tiny-moe: every rank's FLOPs, summed, are one
    process's count of the whole step; the analytic count agrees on every rank."""
    for lay in (dict(tp=2, cp=2), dict(tp=2, pp=2)):
        cfg = RunConfig(model="tiny-moe", global_batch=4, steps=1, measure_memory=False,
                        checkpoint="full").replace(**lay)
        metrics = cluster4.run(jobs.train, cfg).metrics
        step, recomputing, _ = reference(cfg)
        assert sum(m["flops_per_step"] for m in metrics) == step, lay
        assert sum(m["hardware_flops_per_step"] for m in metrics) == recomputing, lay
        assert all(m["flops_analytic"] == m["flops_per_step"] for m in metrics), lay


# ----------------------------------------------------------------------------- the peak

@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An injected clock, load average and matmul rate for :mod:`labkit.measure.cpu_peak`."""
    from labkit.measure import cpu_peak

    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    m = types.SimpleNamespace(now=1000.0, load=6.0, rate=30e9, measured=0)

    def measure(n, seconds, dtype, ranks, barrier):
        m.measured += 1
        return m.rate, 1.5

    monkeypatch.setattr(cpu_peak, "_now", lambda: m.now)
    monkeypatch.setattr(cpu_peak, "_loadavg", lambda: m.load)
    monkeypatch.setattr(cpu_peak, "_measure", measure)
    return m


def test_a_busy_calibration_is_measured_again_when_the_machine_is_quieter(machine):
    from labkit.measure.cpu_peak import cpu_peak_reading

    first = cpu_peak_reading(ranks=2)
    assert (first.flops, first.measured_at, machine.measured) == (30e9, 1000.0, 1)
    assert first.conditions["loadavg_1m"] == 6.0 and first.conditions["ranks"] == 2
    assert first.source.startswith("measured")
    machine.now, machine.load, machine.rate = 1100.0, 5.5, 83e9
    assert cpu_peak_reading(ranks=2).flops == 30e9 and machine.measured == 1  # not quieter
    machine.load = 2.0
    again = cpu_peak_reading(ranks=2)
    assert (again.flops, again.measured_at, machine.measured) == (83e9, 1100.0, 2)
    assert "quieter" in again.source
    # a quieter re-measurement that reads lower leaves the ceiling, confirmed at that load
    machine.load, machine.rate = 0.9, 80e9
    kept = cpu_peak_reading(ranks=2)
    assert (kept.flops, kept.measured_at, kept.confirmed_load, machine.measured) == \
        (83e9, 1100.0, 0.9, 3)
    machine.load = 0.5  # not a full task below the confirmed load: the cache stands
    assert cpu_peak_reading(ranks=2).source == "cached" and machine.measured == 3


def test_an_old_peak_is_replaced_and_a_bare_number_is_not_trusted(machine):
    from labkit.measure.cpu_peak import PEAK_MAX_AGE_S, cache_path, cpu_peak_reading

    cpu_peak_reading()
    machine.now += PEAK_MAX_AGE_S + 1
    machine.rate = 20e9  # lower, but the old value has expired: the new one replaces it
    r = cpu_peak_reading()
    assert (r.flops, machine.measured) == (20e9, 2) and "old" in r.source
    key, = json.loads(cache_path().read_text())
    cache_path().write_text(json.dumps({key: 1e15}))  # the old format: no time, no load
    assert cpu_peak_reading().flops == 20e9 and machine.measured == 3


def _fake_job(cfg, world_size=1):
    ctx = types.SimpleNamespace(cache={}, device=torch.device("cpu"), is_cuda=False,
                                world_size=world_size)
    setup = types.SimpleNamespace(cfg=cfg, mg=None, stages={0: None})
    return ctx, setup


def test_hfu_above_100_percent_remeasures_then_reports_an_error(machine):
    from labkit.train.metrics import flops_and_mfu

    cfg = RunConfig(global_batch=2, checkpoint="full")
    ctx, setup = _fake_job(cfg)
    machine.rate = 1e7  # a peak far too low: this step would run at ~1300 % HFU
    machine.load = 0.0
    cpu = flops_and_mfu(ctx, setup, step_time=1.0)  # first reading, then the refresh
    assert machine.measured == 2 and cpu["mfu"] is None and cpu["hfu"] is None
    assert "> 100 %" in cpu["mfu_error"] and "not a ceiling" in cpu["mfu_error"]
    assert f"{cpu['hardware_flops_per_step']:.4g}" in cpu["mfu_error"]
    assert "measured 0 s ago under {'loadavg_1m': 0.0" in cpu["mfu_error"]  # the peak named
    machine.rate = 1e12  # the re-measurement finds the real ceiling: MFU is shown
    ok = flops_and_mfu(ctx, setup, step_time=1.0)
    assert machine.measured == 3 and ok["mfu_error"] is None and ok["peak_flops"] == 1e12
    assert 0 < ok["mfu"] < ok["hfu"] <= 1
    assert ok["peak_measured_at"] == machine.now and ok["peak_age_s"] == 0.0
    assert ok["peak_conditions"]["loadavg_1m"] == 0.0 and ok["peak_source"] == "measured: asked"


def test_mfu_above_100_percent_is_an_error_not_excellent():
    from labkit.measure.mfu import mfu, mfu_rating

    with pytest.raises(ValueError, match=r"MFU 133\.0 % > 100 %.*1\.33e\+12 FLOP.*1e\+12"):
        mfu(1.33e12, 1.0, 1e12, 1)
    with pytest.raises(ValueError, match=r"HFU 120\.0 % > 100 %"):
        mfu(0.9e12, 1.0, 1e12, 1, hardware_flops_per_step=1.2e12)
    with pytest.raises(ValueError, match="not a rating"):
        mfu_rating(1.33)
    assert mfu(1e12, 1.0, 1e12, 1).mfu == 1.0


def test_the_mfu_gauge_shows_the_peak_and_refuses_a_number_above_100_percent():
    from labkit_widgets import explorer_figures as F

    fig = F.mfu_figure()
    row = {"mfu_pct": 20.0, "hfu_pct": 25.0, "step_ms": 5.0, "peak_gflops": 41.5,
           "peak_age_s": 180.0, "peak_conditions": {"loadavg_1m": 2.1}, "mfu_error": None}
    F.draw_mfu(fig, row, None)
    assert fig.data[0].value == 20.0
    assert "peak 41.5 GFLOP/s/rank · 3 min old · load 2.1" in fig.layout.title.text
    F.draw_mfu(fig, dict(row, mfu_pct=None, hfu_pct=None, mfu_error="HFU 133.0 % > 100 %"), 20.0)
    assert fig.data[0].value is None and "input error" in fig.layout.title.text
    assert "excellent" not in fig.layout.title.text.split("<br>")[0]
    metrics = [{"peak_flops": 41.5e9, "peak_age_s": a, "peak_conditions": {"ranks": 2},
                "peak_source": "cached", "mfu_error": e} for a, e in ((10.0, None), (12.0, "x"))]
    assert F._peak(metrics) == {"peak_gflops": 41.5, "peak_age_s": 12.0, "mfu_error": "x",
                                "peak_conditions": {"ranks": 2}, "peak_source": "cached"}
