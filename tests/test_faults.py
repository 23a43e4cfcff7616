"""Faults injected on the warm cluster: detected, named, recovered (labkit.faults, C39).

One 2-rank pool (the session's ``cluster2``) runs everything: a clean run as the oracle, a
transient bit flip caught and re-run away (losses equal the clean run's exactly), a
straggler named live while the job runs and from the trace after it, a skipped all-reduce
diagnosed (op, group, seq, missing rank, where the sequences diverge), a rank frozen inside
an all-reduce (a stall inside the backend: every member entered; the frozen one named by
its heartbeat, torch's Flight Recorder agreeing), and a SIGKILLed rank recovered by
:func:`run_resilient` (losses equal the clean run's). Three of these restart the pool.
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


def _records(tmp_path, n: int, plan) -> dict:
    """Flight records of ``n`` ranks written through the mapped files: ``plan(rank, rec)``
    writes them; read back as the cluster reads them."""
    from labkit.faults.recorder import FlightRecorder, read_records

    for r in range(n):
        rec = FlightRecorder(str(tmp_path / f"flight{r}"))
        rec.begin_job(1)
        plan(r, rec)
    return {r: read_records(str(tmp_path / f"flight{r}"), r) for r in range(n)}


def test_a_stall_inside_the_backend_is_diagnosed_without_ranks(tmp_path):
    """Every member of [0, 1, 2] entered all-reduce #2 of step 2 and none left: nobody is
    missing, so the report gives the entry times (rank 2 last), each rank's last completed
    collective, and the heartbeats: rank 1's stopped, so it is the one the others wait for;
    with every heartbeat live nobody is blamed. torch's Flight Recorder, planted, agrees
    only when the answering members' last entries are that op of that size at one seq."""
    from labkit.faults.diagnose import diagnose
    from labkit.faults.watch import fr_agreement

    beats = {0: 109.9, 1: 104.5, 2: 109.95}

    def plan(r, rec):
        for step in range(3):
            rec.set_step(step)
            slot = rec.enter("all_reduce", (0, 1, 2), 64, 100.0 + step + 0.01 * r)
            if step < 2:
                rec.exit(slot, 100.0 + step + 0.5)
        rec.beat(beats[r])

    by_rank = _records(tmp_path, 3, plan)
    rep = diagnose(by_rank, now=110.0, states={1: "stopped (T)"})
    assert rep.in_backend and rep.missing == () and rep.entered == (0, 1, 2)
    assert (rep.op, rep.group, rep.seq, rep.step, rep.numel) == ("all_reduce", (0, 1, 2), 2,
                                                                 2, 64)
    assert rep.entered_at == pytest.approx({0: 0.0, 1: 0.01, 2: 0.02})
    assert rep.last_entered == 2 and rep.waited_s == pytest.approx(8.0)
    assert rep.heartbeat_age_s == pytest.approx({0: 0.1, 1: 5.5, 2: 0.05})
    assert rep.frozen == (1,) and rep.culprit == 1
    text = str(rep)
    assert "every member entered it" in text and "rank 2 last" in text
    assert "rank 1: heartbeat stopped 5.5 s ago" in text and "kernel: stopped (T)" in text
    assert "last completed all_reduce #1 on group [0, 1, 2] (step 1)" in text
    assert "the others wait for rank 1, frozen inside all_reduce #2" in text
    by_rank[1].heartbeat = 109.8  # every process alive: the backend itself is stuck
    rep2 = diagnose(by_rank, now=110.0)
    assert rep2.frozen == () and rep2.culprit is None and "no rank can be blamed" in str(rep2)

    fr = {0: (("0", "pg"), 7, "gloo:all_reduce", "scheduled", [[8, 8]]),
          2: (("0", "pg"), 7, "gloo:all_reduce", "scheduled", [[64]])}
    assert "agrees" in fr_agreement(rep, fr) and "rank 1: did not answer (it is frozen)" in \
        fr_agreement(rep, fr)
    assert "DISAGREES" in fr_agreement(rep, {**fr, 2: (("0", "pg"), 6, "gloo:all_reduce",
                                                       "scheduled", [[64]])})  # other seq
    assert "DISAGREES" in fr_agreement(rep, {**fr, 0: (("0", "pg"), 7, "gloo:broadcast",
                                                       "scheduled", [[64]])})  # other op
    assert "DISAGREES" in fr_agreement(rep2, fr)  # rank 1 is alive: it should have answered


def test_live_straggler_from_flight_records_without_ranks(tmp_path):
    """Rank 1 keeps ranks 0 and 2 waiting 0.3 s from step 2 on (three collectives a step,
    only the first delayed, the others entered last by 1 ms); a one-off 0.4 s delay of
    rank 0 in step 1 is noise. Fed the
    records as they grow, the rule names rank 1 exactly when it enters the third late
    step's collective, with its lateness and that collective, and never rank 0."""
    from labkit.faults.straggler import live_stragglers

    def plan_upto(last):
        def plan(r, rec):
            t = 0.0
            for step in range(6):
                rec.set_step(step)
                for k in range(3):
                    if (step, k) > last:
                        return
                    t += 1.0
                    delay = (0.3 if r == 1 and step >= 2 and k == 0 else
                             0.4 if r == 0 and step == 1 and k == 0 else 0.0)
                    noise = (0.0, 0.002, 0.001)[r]  # rank 1 is also last, barely, at k > 0
                    rec.exit(rec.enter("all_reduce", (0, 1, 2), 16, t + delay + noise),
                             t + 0.5)
        return plan

    seen = []
    for last in [(s, k) for s in range(6) for k in range(3)]:
        found = live_stragglers(_records(tmp_path, 3, plan_upto(last)), threshold_s=0.2)
        seen.append((last, [f.rank for f in found]))
        if found:
            break
    assert seen[-1] == ((4, 0), [1]) and all(not f for _, f in seen[:-1]), seen
    s, = found
    assert (s.rank, s.group, s.op, s.seq, s.step, s.late) == (1, (0, 1, 2), "all_reduce", 12,
                                                              4, 3)
    assert s.late_s == pytest.approx(0.302)
    assert s.t_seen == pytest.approx(13.302)
    assert "rank 1 is a straggler: in 3 of the last 4 steps" in str(s)
    assert live_stragglers(_records(tmp_path, 3, plan_upto((4, 0))), threshold_s=0.35) == []
    with pytest.raises(ValueError, match="min_late=5 must be between 1 and window=4"):
        live_stragglers({}, 0.1, min_late=5)


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
def test_faults_on_the_warm_cluster(cluster2, tmp_path, monkeypatch):
    clean = cluster2.run(jobs.train, BASE.replace(straggler_s=0.15))
    assert clean.metrics[0]["faults_injected"] == [] and clean.faults == []

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

    # a straggler: rank 0 sleeps 0.25 s per step from step 1; its peer waits for it. Named
    # live (while the job runs: RunResult.faults is filled only then), from the flight
    # records, at its third late step, and again from the trace after the job. The job
    # runs 9 steps so that a driver starved of CPU (CI at load) still sees it before the end
    slow = cluster2.run(jobs.train, BASE.replace(steps=9, fault="slow@1:rank0:seconds=0.25",
                                                 straggler_s=0.15))
    live, = slow.faults
    s = live.extra["straggler"]
    assert (live.kind, live.rank, s.group) == ("straggler", 0, (0, 1)) and s.late >= 3, \
        live.message
    assert 0.15 < s.late_s < 1.0 and 1 <= s.step < 8 and live.step == s.step
    # bound: one poll (0.25 s) after the deciding entry; generous for a loaded machine
    assert live.injected_at < s.t_seen <= live.detected_at < s.t_seen + 2.0
    assert cluster2.faults[-1] is live
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
    # (the pool restarts: the rest uses a job far cheaper than training on fresh ranks;
    # the fresh pool records torch's Flight Recorder too)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "256")
    with pytest.raises(CollectiveHang) as err:
        cluster2.run(all_reduce_steps, SkipConfig(steps=4, fault="skip@1:rank1"))
    hang = err.value.fault.hang
    assert (hang.op, hang.group, hang.seq, hang.step) == ("all_reduce", (0, 1), 3, 3)
    assert hang.entered == (0,) and hang.missing == (1,) and err.value.fault.rank == 1
    assert "diverge at #1" in hang.divergence and "ranks [1]" in hang.divergence
    assert "all_reduce #3 on group [0, 1]" in str(err.value)
    assert 2.0 <= hang.waited_s < 30.0  # watchdog_s=2; generous bound
    assert cluster2.faults[-1] is err.value.fault

    # a stall inside the backend: rank 1 enters step 1's all-reduce and freezes (SIGSTOP);
    # nobody is missing, so the report gives who entered when, the last completed
    # all-reduce, and the heartbeats: rank 1's stopped. torch's Flight Recorder agrees
    # (first a run on the restarted pool without a watchdog: a rank still starting under a
    # loaded machine must not count as a hang)
    assert cluster2.run(all_reduce_steps, SkipConfig(steps=1, watchdog_s=None)).outputs == \
        [[3.0], [3.0]]
    with pytest.raises(CollectiveHang) as err:
        cluster2.run(all_reduce_steps, SkipConfig(steps=4, fault="stall@1:rank1"))
    hang, text = err.value.fault.hang, str(err.value)
    assert (hang.op, hang.group, hang.seq, hang.step) == ("all_reduce", (0, 1), 1, 1)
    assert hang.in_backend and hang.entered == (0, 1) and hang.missing == ()
    assert hang.frozen == (1,) and err.value.fault.rank == 1 and "stopped (T)" in \
        hang.proc_state[1]
    assert "every member entered it" in text and "heartbeat stopped" in text
    assert "last completed all_reduce #0 on group [0, 1] (step 0)" in text
    assert "torch Flight Recorder agrees" in text and "rank 1: did not answer (it is " \
        "frozen)" in text, text
    assert 2.0 <= err.value.fault.detect_s < 30.0

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
