"""Faults injected on the warm cluster: detected, named, recovered (labkit.faults, C39).

One 2-rank pool (the session's ``cluster2``) runs everything: a clean run as the oracle, a
transient bit flip caught and re-run away (losses equal the clean run's exactly), a
straggler named from the trace, a skipped all-reduce diagnosed (op, group, seq, missing
rank, where the sequences diverge), and a SIGKILLed rank recovered by
:func:`run_resilient` (losses equal the clean run's). Two of these restart the pool.
Bounds are structural or generous (detection well under the watchdog plus the job's
timeout); the timings themselves are in benchmarks/fault_recovery.py.
"""
from __future__ import annotations

import math
import random

import pytest

from labkit import jobs
from labkit.config import RunConfig
from labkit.faults import parse_faults
from labkit.faults.goodput import (LLAMA3, daly_interval, expected_goodput, llama3_example,
                                   young_interval)
from labkit.faults.recover import resume_config, run_resilient
from labkit.faults.sdc import ReplicaCheck, SilentDataCorruption, checksum
from labkit.faults.straggler import stragglers
from labkit.faults.watch import CollectiveHang, RankDied

from jobs_faults import SkipConfig, all_reduce_steps

BASE = RunConfig(parallel=dict(dp=2), steps=4, global_batch=4, measure_memory=False,
                 count_flops=False, timeout_s=60)


# ------------------------------------------------------------------ before launch (no ranks)
def test_fault_strings_parse_and_bad_ones_are_refused_naming_the_numbers():
    f, = parse_faults("bitflip@2:rank1:target=param:bit=3:persistent=1")
    assert (f.kind, f.step, f.rank, f.target, f.bit, f.persistent) == ("bitflip", 2, 1, "param",
                                                                       3, True)
    assert parse_faults(str(f)) == (f,)
    assert [x.kind for x in parse_faults("kill@1:rank0, slow@0:rank1:seconds=0.5")] == \
        ["kill", "slow"]
    bad = {"kill@9:rank1": "step=9 is outside the run's steps 0..3",
           "kill@1:rank2": "rank=2 is outside the job's ranks 0..1",
           "melt@1:rank0": "kind 'melt'", "kill@1": "KIND@STEP:rankR",
           "skip@1:rank0:op=gather": "op='gather'", "kill@0:rank0:colour=red": "unknown option",
           "bitflip@1:rank0:bit=40": "bit=40", "kill@0:rank0,hang@1:rank1": "at most one"}
    for text, words in bad.items():
        with pytest.raises(ValueError, match="fault") as err:
            BASE.replace(fault=text).validate(2)
        assert words in str(err.value), (text, str(err.value))
    with pytest.raises(ValueError, match="full replicas.*dp=1"):
        BASE.replace(dp=1, fault="bitflip@0:rank0").validate(2)
    with pytest.raises(ValueError, match="fingerprint_every=2 .*zero_stage=3"):
        BASE.replace(fingerprint_every=2, zero_stage=3).validate(2)
    with pytest.raises(ValueError, match="watchdog_s=90 must be below timeout_s=60"):
        BASE.replace(watchdog_s=90).validate(2)


def test_checksum_sees_every_single_bit():
    import torch

    from labkit.faults.inject import flip_bit

    t = torch.randn(64)
    ref = checksum([t])
    for bit in range(32):
        u = t.clone()
        flip_bit(u, 5, bit)
        assert checksum([u]) != ref, bit
        flip_bit(u, 5, bit)
        assert checksum([u]) == ref and torch.equal(u, t)


def test_replica_check_tells_transient_from_persistent():
    """The decision logic on planted checksums (4 replicas): a flip that a re-run clears
    names the rank whose sum changed; one that survives it is persistent, named by majority."""
    runs = []

    def fake(sums_per_run):
        check = ReplicaCheck([], every=1, rank=0)
        it = iter(sums_per_run)
        check._sums = lambda what: [next(it)]
        return check

    good = {0: 7, 1: 7, 2: 7, 3: 7}
    check = fake([{**good, 2: 9}, good])
    check.check_grads(5, lambda: runs.append("rerun"))
    assert runs == ["rerun"] and check.events[0].ranks == (2,) and \
        check.events[0].verdict == "transient" and check.events[0].step == 5
    check = fake([{**good, 3: 9}, {**good, 3: 9}])
    with pytest.raises(SilentDataCorruption, match="persistent") as err:
        check.check_grads(4, lambda: None)
    assert check.events[0].ranks == (3,) and "rank(s) [3]" in str(err.value)
    check = fake([good])
    check.check_grads(1, lambda: runs.append("never"))
    assert runs == ["rerun"] and not check.events


def test_flight_records_diagnose_a_skip_without_ranks(tmp_path):
    """Three ranks' flight records written and read back through the mapped files: rank 2
    skipped the step-1 all-reduce of group [0, 1, 2], so the others wait in #3 (step 3)."""
    from labkit.faults.recorder import FlightRecorder, diagnose, divergences, read_records

    recs = {r: FlightRecorder(str(tmp_path / f"flight{r}")) for r in range(3)}
    for r, rec in recs.items():
        rec.begin_job(7)
        t = 100.0
        for step in range(4):
            rec.set_step(step)
            if r == 2 and step == 1:
                continue  # the skip
            slot = rec.enter("all_reduce", (0, 1, 2), 64, t + step)
            if not (r < 2 and step == 3):  # ranks 0 and 1 are stuck in step 3's
                rec.exit(slot, t + step + 0.1)
        rec.enter("broadcast", (0, 1), 8, t + 5) if r == 1 else None
    by_rank = {r: read_records(str(tmp_path / f"flight{r}"), r) for r in range(3)}
    assert by_rank[0].job == 7 and by_rank[0].step == 3 and len(by_rank[0].records) == 4
    assert by_rank[0].records[2].t_exit == pytest.approx(102.1)
    report = diagnose(by_rank, now=110.0)
    assert (report.op, report.group, report.seq, report.step) == ("all_reduce", (0, 1, 2), 3, 3)
    assert report.entered == (0, 1) and report.missing == (2,)
    assert report.waited_s == pytest.approx(7.0)
    assert "diverge at #1" in report.divergence and "step 2" in report.divergence
    assert "last collective on this group was all_reduce #2 (step 3)" in report.where[2]
    assert len(divergences(by_rank)) == 1
    assert diagnose({r: by_rank[2] for r in (2,)}, now=110.0) is None  # nobody waiting


# ------------------------------------------------------------------------- goodput planner
def _simulated_goodput(tau, delta, mtbf, restart, work, rng) -> float:
    """Monte Carlo of exponential failures with checkpoints: the oracle for Daly's formula."""
    done = wall = 0.0
    next_fail = rng.expovariate(1 / mtbf)
    while done < work:
        seg = min(tau, work - done) + delta
        if wall + seg <= next_fail:
            wall += seg
            done += seg - delta
            continue
        wall = next_fail  # the segment is lost; restart, again if a failure interrupts it
        while True:
            next_fail = wall + rng.expovariate(1 / mtbf)
            if next_fail >= wall + restart:
                wall += restart
                break
            wall = next_fail
    return work / wall


def test_goodput_formula_matches_a_simulation_and_young_daly_are_near_its_optimum():
    delta, mtbf = 30.0, 3000.0
    rng = random.Random(0)
    for tau, restart in ((100.0, 0.0), (420.0, 0.0), (1500.0, 0.0), (420.0, 120.0)):
        sim = _simulated_goodput(tau, delta, mtbf, restart, 2e7, rng)  # ~7000 failures
        assert abs(sim - expected_goodput(tau, delta, mtbf, restart)) < 0.005, tau
    grid = [10.0 * k for k in range(1, 1000)]
    best = max(grid, key=lambda t: expected_goodput(t, delta, mtbf))
    assert young_interval(delta, mtbf) == pytest.approx(math.sqrt(2 * 30 * 3000))
    assert abs(daly_interval(delta, mtbf) - best) <= 10.0  # the numerical optimum, ±1 step
    assert abs(young_interval(delta, mtbf) - best) / best < 0.1
    assert expected_goodput(best, delta, mtbf) > expected_goodput(best * 3, delta, mtbf)
    with pytest.raises(ValueError, match="mtbf_s must be a finite number > 0"):
        young_interval(30, 0)


def test_c39_llama3_interruptions_worked_example():
    """C39: 54 days, 466 interruptions, 419 unplanned (Dubey et al. 2024, Table 5)."""
    assert (LLAMA3["days"], LLAMA3["interruptions"], LLAMA3["unplanned"]) == (54, 466, 419)
    ex = llama3_example(ckpt_s=60.0, restart_s=600.0)
    assert ex["mtbf_s"] == pytest.approx(54 * 86400 / 419)  # ~3.1 hours
    assert 3.0 < ex["mtbf_s"] / 3600 < 3.2 and ex["interrupts_per_day"] == pytest.approx(419 / 54)
    assert ex["young_s"] == pytest.approx(math.sqrt(2 * 60 * 54 * 86400 / 419))
    assert ex["goodput_at_optimum"] > ex["goodput_hourly"]
    assert llama3_example(unplanned_only=False)["mtbf_s"] < ex["mtbf_s"]


def test_resume_starts_at_the_last_snapshot_before_the_fault():
    with pytest.raises(ValueError, match="needs save_dir"):
        resume_config(BASE, 2)
    cfg = BASE.replace(steps=9, save_dir="/tmp/x", save_every=3)
    assert [(c.resume, s) for c, s in (resume_config(cfg, k) for k in (0, 2, 3, 5, 8))] == \
        [(False, 0), (False, 0), (True, 3), (True, 3), (True, 6)]


# ----------------------------------------------------------------------- on the warm ranks
@pytest.mark.distributed
def test_faults_on_the_warm_cluster(cluster2, tmp_path):
    clean = cluster2.run(jobs.train, BASE)
    assert clean.metrics[0]["faults_injected"] == []

    # a transient bit flip in rank 1's reduced gradient at step 1: caught, re-run away
    sdc = cluster2.run(jobs.train, BASE.replace(fault="bitflip@1:rank1", fingerprint_every=1))
    assert sdc.losses == clean.losses  # exactly: the re-run's gradients are the clean ones
    for m in sdc.metrics:
        ev, = m["sdc"]["events"]
        assert (ev["step"], ev["what"], ev["ranks"], ev["verdict"]) == (1, "grad", [1],
                                                                        "transient")
    assert sdc.metrics[1]["faults_injected"] == ["bitflip@1:rank1:target=grad:bit=30:index=0"]
    # the fingerprint's own collectives are in the trace, 8 bytes per rank each
    fps = [e for e in sdc.trace.filter(rank=0, op="all_gather") if "fingerprint" in e.args]
    assert len(fps) == 2 * 4 + 1  # grads and params every step, plus the re-run's check

    # a straggler: rank 0 sleeps 0.25 s per step from step 1; its peer waits for it
    slow = cluster2.run(jobs.train, BASE.replace(fault="slow@1:rank0:seconds=0.25"))
    rep = stragglers(slow.trace, threshold_s=0.15, from_step=1)
    assert rep.slow == [0] and rep.lateness_s[0] > 0.15, str(rep)
    # said in words: which rank, how many collectives it entered last, its latest one
    late_s, late_step, late_op = rep.worst[0]
    assert rep.last_count[0] == rep.collectives and late_step >= 1 and late_s >= 0.15
    assert str(rep).startswith(f"rank 0 is a straggler: the last to enter {rep.collectives} "
                               f"of the {rep.collectives} collectives from step 1 on,\n"
                               f"  a median "), str(rep)
    assert f"(step {late_step}'s {late_op}) {late_s * 1e3:.0f} ms after" in str(rep), str(rep)
    assert stragglers(clean.trace, threshold_s=0.15, from_step=1).slow == []

    # a skipped all-reduce: the hang names the op, the group, the seq, the missing rank
    # (the pool restarts: the rest uses a job far cheaper than training on fresh ranks)
    with pytest.raises(CollectiveHang) as err:
        cluster2.run(all_reduce_steps, SkipConfig(steps=4, fault="skip@1:rank1"))
    hang = err.value.fault.hang
    assert (hang.op, hang.group, hang.seq, hang.step) == ("all_reduce", (0, 1), 3, 3)
    assert hang.entered == (0,) and hang.missing == (1,) and err.value.fault.rank == 1
    assert "diverge at #1" in hang.divergence and "ranks [1]" in hang.divergence
    assert "all_reduce #3 on group [0, 1]" in str(err.value)
    assert 2.0 <= hang.waited_s < 30.0  # watchdog_s=2; generous bound
    assert cluster2.faults[-1] is err.value.fault

    # a SIGKILLed rank at step 3: named, the pool restarted, resumed from the snapshot
    # after step 2 (labkit.snapshot); the resumed losses are the uninterrupted run's
    seen = []
    run = run_resilient(cluster2, BASE.replace(fault="kill@3:rank1", save_dir=str(tmp_path),
                                               save_every=2), resume=True,
                        on_fault=lambda cost, exc: seen.append((cost, exc)))
    (cost, exc), = seen
    assert isinstance(exc, RankDied) and "killed by SIGKILL in step 3" in str(exc)
    assert exc.fault.extra["exitcode"] == -9
    assert (cost.kind, cost.rank, cost.step, cost.lost_steps) == ("killed", 1, 3, 1)
    assert 0 <= cost.detect_s < 10.0 and cost.recovery_s > 0 and cost.lost_s > 0
    assert [m["first_step"] for m in run.result.metrics] == [2, 2]
    assert run.result.losses == clean.losses[2:]
