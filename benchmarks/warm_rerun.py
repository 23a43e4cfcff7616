"""Warm re-run overhead of a 4-rank cluster (DESIGN.md §2.5: sub-second for the tiny model).

* cold start: ``Cluster(4)`` construction plus the first ``hello`` job (ranks import torch
  and join the process group);
* ``labkit.jobs.hello`` 50 times on the warm pool: overhead = wall time of ``run`` in the
  caller minus the job's own span on the ranks (its traced events, first start to last end);
* ``labkit.jobs.train`` (tiny, 1 step, dp=4): wall time of ``run`` minus the ranks' own job
  time (a traced ``job`` region around ``labkit.train.run``);
* a slider re-run of an unchanged composition, ``pp=2 × dp=2`` on 4 ranks (3 steps, memory
  and FLOPs measured as the explorer does): wall time of ``run`` minus the job's own steps
  (first step's start to the last step's end, over all ranks, from the trace). That rest is
  what a re-run costs beyond training: dispatch, building the model and its wrappers
  (a warm rank reuses its composed stages: :mod:`labkit.train.cache`), reading cached FLOP
  counts and peaks, the metrics, sending the trace back. The ranks' resident size before
  and after these re-runs says whether what the warm ranks keep stays bounded.

Targets: hello overhead median <= 0.5 s; the composition's overhead beyond its steps
<= 50 ms. Prints ``RESULT warm_rerun_overhead_median_s <s>``,
``RESULT rerun_beyond_steps_median_s <s>`` and ``RESULT rerun_rss_growth_mib <MiB>``.

``--breakdown`` then says where the composition's re-run time goes, per component, in CPU
milliseconds (what a loaded machine disturbs least) and wall milliseconds: each rank runs
the job with its phases timed and its garbage collections counted (:func:`phases_train`),
and the caller counts its own CPU inside ``Cluster.run``. Those runs are spaced by a short
pause, as a user's slider moves are.

    .venv/bin/python benchmarks/warm_rerun.py [--breakdown] [--runs 20]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # benchjobs, importable by the ranks (Cluster passes sys.path)
sys.path.insert(0, os.path.dirname(HERE))

TARGET_S = 0.5
TARGET_BEYOND_S = 0.05


def _p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]


def _span(events):
    return (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0


def _rss(pids) -> list:
    """Resident set size of each process, MiB."""
    import psutil

    return [psutil.Process(p).memory_info().rss / 2**20 for p in pids]


def _timed(cluster, job, cfg=None):
    t0 = time.perf_counter()
    r = cluster.run(job, cfg)
    return r, time.perf_counter() - t0


#: labkit.train's phases that phases_train times: (module, function)
PHASES = (("labkit.train", "build_rank"), ("labkit.train.pipeline", "make_executor"),
          ("labkit.train", "run_steps"), ("labkit.train", "_global_losses"),
          ("labkit.train", "memory_metrics"), ("labkit.train", "comm_metrics"),
          ("labkit.train", "flops_and_mfu"), ("labkit.train.pipeline", "p2p_latency"))
#: parts of build_rank timed too (inside its time)
BUILD_PHASES = (("labkit.train.build", "reuse_stages"), ("labkit.train.build", "_compose_stages"),
                ("labkit.train.build", "_data_parallel"), ("labkit.train.build", "_optimizer"))


#: CPU seconds of every garbage collection in this rank since the last phases_train read it
_GC = {"cpu_s": 0.0, "t0": None, "n": 0}


def _gc_timer(phase, info):
    if phase == "start":
        _GC["t0"] = time.thread_time()
    elif _GC["t0"] is not None:
        _GC["cpu_s"] += time.thread_time() - _GC["t0"]
        _GC["n"] += 1
        _GC["t0"] = None


def phases_train(ctx, cfg) -> dict:
    """``labkit.train.run`` with each of :data:`PHASES` timed on this rank: ``out["phases"]
    = {name: (thread CPU s, wall s)}``; ``out["job_cpu_s"]`` and ``out["steps_cpu_s"]`` the
    process CPU (every thread, gloo's too) of the whole job and inside ``run_steps``;
    ``out["gc_cpu_s"]`` the CPU of the garbage collections between the previous call's end
    and this one's start (the rank loop's after that job), ``out["gc_during_cpu_s"]`` those
    during this job. The functions are wrapped for this job only."""
    import gc
    import importlib

    from labkit import train

    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)
    gc_cpu, _GC["cpu_s"] = _GC["cpu_s"], 0.0
    times: dict = {}
    real = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            c0, t0, p0 = time.thread_time(), time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = (time.thread_time() - c0, time.perf_counter() - t0)
                if name == "run_steps":
                    times["steps_cpu_s"] = time.process_time() - p0
        return wrapper

    for mod, name in PHASES + BUILD_PHASES:
        m = importlib.import_module(mod)
        if not hasattr(m, name):
            continue
        real[(m, name)] = getattr(m, name)
        setattr(m, name, timed(name, real[(m, name)]))
    c0, p0 = time.thread_time(), time.process_time()
    try:
        out = train.run(ctx, cfg)
    finally:
        for (m, name), fn in real.items():
            setattr(m, name, fn)
    out["job_thread_cpu_s"] = time.thread_time() - c0
    out["job_cpu_s"] = time.process_time() - p0
    out["gc_during_cpu_s"], _GC["cpu_s"] = _GC["cpu_s"], 0.0
    out["steps_cpu_s"] = times.pop("steps_cpu_s")
    out["gc_cpu_s"] = gc_cpu
    out["phases"] = times
    return out


def breakdown(cluster, cfg, runs: int, pause_s: float = 0.3) -> None:
    """Print where a warm re-run of ``cfg`` spends its time (see the module docstring)."""
    job = "warm_rerun:phases_train"
    cluster.run(job, cfg)
    cluster.run(job, cfg)
    rows: dict = {}

    def add(name, rank, cpu_s, wall_s=None):
        rows.setdefault(name, {}).setdefault(rank, []).append((cpu_s, wall_s))

    for _ in range(runs):
        time.sleep(pause_s)
        k0 = time.process_time()
        t0 = time.perf_counter()
        r = cluster.run(job, cfg)
        wall = time.perf_counter() - t0
        k1 = time.process_time()
        steps = [e for e in r.trace.events if e.step >= 0]
        s0, s1 = min(e.start for e in steps), max(e.end for e in steps)
        add("wall beyond the steps (first step's start to last step's end)", "all", None,
            wall - (s1 - s0))
        add("  before the first step: dispatch, rank loop, build", "all", None, s0 - t0)
        add("  after the last step: metrics, results back, trace merge", "all", None,
            t0 + wall - s1)
        add("caller: CPU inside Cluster.run", "caller", k1 - k0)
        for rank, o in enumerate(r.outputs):
            ph = o["phases"]
            add("rank: process CPU of labkit.train.run beyond run_steps", rank,
                o["job_cpu_s"] - o["steps_cpu_s"])
            inner = [n for _, n in BUILD_PHASES]
            for name in ["build_rank"] + inner + [n for _, n in PHASES[1:]]:
                if name in ph and name != "run_steps":
                    add(f"  {'  ' if name in inner else ''}thread CPU of {name}", rank, *ph[name])
            add("  thread CPU of the rest of labkit.train.run", rank, o["job_thread_cpu_s"]
                - sum(c for n, (c, _) in ph.items() if n not in inner), None)
            add("  of which automatic garbage collections (during the steps too)", rank,
                o["gc_during_cpu_s"])
            add("rank: garbage collection after the previous job (rank loop)", rank,
                o["gc_cpu_s"])
    print(f"\nwhere a warm re-run of {cfg.parallel} goes ({runs} runs {pause_s} s apart; "
          f"median over runs, mean over ranks; load avg {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores)")
    print(f"{'component':<66}{'CPU ms':>9}{'wall ms':>9}")
    for name, per in rows.items():
        cpus = [statistics.median(c for c, _ in v) for v in per.values() if v[0][0] is not None]
        walls = [statistics.median(w for _, w in v) for v in per.values() if v[0][1] is not None]
        c = f"{1e3 * statistics.mean(cpus):9.2f}" if cpus else f"{'':9}"
        w = f"{1e3 * statistics.mean(walls):9.2f}" if walls else f"{'':9}"
        print(f"{name:<66}{c}{w}")


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--breakdown", action="store_true",
                    help="then time the composition's re-run per component")
    ap.add_argument("--runs", type=int, default=20, help="re-runs of the composition")
    args = ap.parse_args()

    import labkit
    from labkit import jobs
    from labkit.config import RunConfig

    import benchjobs

    t0 = time.perf_counter()
    cluster = labkit.Cluster(world_size=4, backend="gloo", device="cpu")
    construct = time.perf_counter() - t0
    cluster.run(jobs.hello)
    cold = time.perf_counter() - t0
    try:
        hello = []
        for _ in range(50):
            r, wall = _timed(cluster, jobs.hello)
            hello.append((wall, _span(r.trace.events)))
        cfg = RunConfig(model="tiny", steps=1, global_batch=8).replace(dp=4)
        cluster.run(benchjobs.timed_train, cfg)  # first run: FLOP count + peak calibration
        train = []
        for _ in range(10):
            r, wall = _timed(cluster, benchjobs.timed_train, cfg)
            train.append((wall, max(e.duration for e in r.trace.filter(name="job"))))
        comp = RunConfig(model="tiny", steps=3, global_batch=8).replace(dp=2, pp=2)
        cluster.run(jobs.train, comp)  # first run: FLOP counts, peak, groups
        cluster.run(jobs.train, comp)  # second: what the warm ranks keep is in place
        rss0 = _rss(cluster.pids)
        beyond = []
        for _ in range(args.runs):
            r, wall = _timed(cluster, jobs.train, comp)
            steps = [e for e in r.trace.events if e.step >= 0]
            beyond.append((wall, _span(steps)))
        growth = [b - a for a, b in zip(rss0, _rss(cluster.pids))]
        if args.breakdown:
            breakdown(cluster, comp, args.runs)
    finally:
        cluster.close()

    print(f"cold start: Cluster(4) construction {construct:.3f} s, + first hello job "
          f"= {cold:.2f} s")
    print(f"{'job':<24}{'runs':>5}{'wall med s':>12}{'job med s':>11}"
          f"{'overhead med s':>16}{'overhead p90 s':>16}")
    rows = {}
    for name, data in (("hello (4 ranks)", hello), ("train tiny 1 step dp=4", train),
                       ("pp2 x dp2, beyond steps", beyond)):
        over = [w - j for w, j in data]
        rows[name] = over
        print(f"{name:<24}{len(data):>5}{statistics.median(w for w, _ in data):>12.4f}"
              f"{statistics.median(j for _, j in data):>11.4f}"
              f"{statistics.median(over):>16.4f}{_p90(over):>16.4f}")
    med = statistics.median(rows["hello (4 ranks)"])
    print(f"target: hello overhead median <= {TARGET_S} s -> {'OK' if med <= TARGET_S else 'MISSED'}"
          f"  (load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    print(f"RESULT warm_rerun_overhead_median_s {med:.4f}")
    b = statistics.median(rows["pp2 x dp2, beyond steps"])
    print(f"target: pp2 x dp2 re-run beyond its steps <= {1e3 * TARGET_BEYOND_S:.0f} ms -> "
          f"{'OK' if b <= TARGET_BEYOND_S else 'MISSED'}")
    print(f"RESULT rerun_beyond_steps_median_s {b:.4f}")
    print(f"rank RSS growth over the {args.runs} re-runs (MiB): "
          + " ".join(f"{g:+.1f}" for g in growth))
    print(f"RESULT rerun_rss_growth_mib {max(growth):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
