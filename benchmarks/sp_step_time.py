"""Step time of the tiny model, TP2 + SP, bf16 on two CPU ranks: this checkout against the
labkit before the layer-memory change (issue 30), side by side in one run.

"Before" is labkit at ``--before-commit`` (default ``bc70be4``, the parent of the change
that made SP keep the ``S/T`` shard and re-gather it in backward, RMSNorm an autograd
Function and GQA SDPA's ``enable_gqa``), unpacked with ``git archive`` into a temporary
directory, or ``--before DIR`` (a directory holding ``labkit/``). "After" is this checkout.

Fairness: each arm runs in its own driver process holding a warm 2-rank gloo cluster
(``threads_per_rank=1``; the job sets ``torch.set_num_threads(1)`` again); the drivers take
turns run by run in the order A B B A, so drift in the machine's load hits both arms alike.
Every run builds the job's rank (``build_rank``) and times ``--steps`` steps of the job's own
``make_step`` (forward, backward, gradient sync, AdamW), each starting at a barrier
(benchmarks/benchjobs/sp.py); a step's time is the slowest rank's; a run's time the median
of its steps after the first two. Reported: median over runs of each arm, their ratio, the
median and quartiles of the per-round ratios (one round = A B B A), and the same for the
CPU seconds a step costs (all threads of a rank, the slower rank's), which waiting for a core
does not inflate. The 1-minute load average over the rounds is printed beside them.

    python benchmarks/sp_step_time.py [--rounds 10 --steps 12] [--before DIR]
    python benchmarks/sp_step_time.py --profile [--before DIR]   # torch.profiler, rank 0

Prints ``RESULT sp_step_time before_ms=... after_ms=... ratio=... cpu_ratio=... load=...``.

Measured (2 cores shared by several engineers' jobs, after the backward collectives were
overlapped), three runs of 10-12 rounds: wall after/before 1.209, 1.025 and 1.104 (round
ratios' medians 1.125, 1.082, 1.194; quartiles as wide as 0.79-1.47; load 18-37); CPU per
step 1.070, 1.257 and 1.104. So the step is not shown within 1.05x of before: two of three
wall ratios and all CPU ratios are above it (and the round ratios spread wider than 5 %).
The CPU seconds say the change costs work: 5 more all-gathers per step (the re-gathers of 2 blocks' attention and MLP inputs and of the head's), each about
0.4-0.5 ms of CPU on gloo here, which overlapping hides from the wall time only where a
core is free. Op counts per step under torch.profiler (``--profile``), before -> after:
c10d collectives 27 -> 32; ``aten::to`` 226 -> 270 (no-op casts in the re-gathering
backward), ``aten::_to_copy`` 197 -> 199 (the weights cast to bf16 again in that
backward); ``aten::mm`` 45 both; RMSNorm 5 autograd Functions in place of the plain ops'
nodes; the tiny model has as many K/V as query heads, so SDPA's ``enable_gqa`` is off.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEFORE_COMMIT = "bc70be4"


def config(steps: int):
    from labkit.config import ParallelConfig, RunConfig

    return RunConfig(model="tiny", parallel=ParallelConfig(tp=2), global_batch=8, steps=steps,
                     precision="bf16", sequence_parallel=True, count_flops=False,
                     measure_memory=False)


def serve(steps: int) -> None:
    """Driver: a warm cluster of this process's labkit; one JSON line per ``run`` read."""
    sys.path.insert(0, HERE)
    import labkit
    from benchjobs.sp import sp_profile, sp_step_times

    cfg = config(steps)
    with labkit.Cluster(world_size=2, backend="gloo", device="cpu", threads_per_rank=1) as c:
        c.run(sp_step_times, replace(cfg, steps=3))  # warm-up: imports, allocator
        print(json.dumps({"ready": labkit.__file__}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "run":
                outs = c.run(sp_step_times, cfg).outputs
                wall = [max(o["wall"][s] for o in outs) for s in range(2, steps)]
                cpu = [max(o["cpu"][s] for o in outs) for s in range(2, steps)]
                print(json.dumps({"wall": statistics.median(wall),
                                  "cpu": statistics.median(cpu)}), flush=True)
            elif cmd == "profile":
                print(json.dumps({"table": c.run(sp_profile, cfg).outputs[0]}), flush=True)
            else:
                return


def before_dir(commit: str) -> str:
    """``labkit/`` at ``commit`` of this repository, unpacked once into a temporary folder."""
    dest = os.path.join(tempfile.gettempdir(), f"labkit-before-{commit}")
    if not os.path.isdir(os.path.join(dest, "labkit")):
        os.makedirs(dest, exist_ok=True)
        tar = subprocess.run(["git", "-C", ROOT, "archive", commit, "labkit"],
                             capture_output=True, check=True).stdout
        with tempfile.TemporaryFile() as f:
            f.write(tar)
            f.seek(0)
            with tarfile.open(fileobj=f) as t:
                t.extractall(dest, filter="data")
    return dest


class Driver:
    def __init__(self, path: str, steps: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, HERE]))
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve",
                                   "--steps", str(steps)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.labkit = self._read()["ready"]

    def _read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("benchmark driver exited")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.write("quit\n")
        self.p.stdin.close()
        self.p.wait(timeout=60)


def quartiles(xs) -> tuple:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", metavar="DIR", help="a directory holding the old labkit/")
    ap.add_argument("--before-commit", default=BEFORE_COMMIT)
    ap.add_argument("--rounds", type=int, default=10, help="A B B A rounds")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        return serve(a.steps)
    paths = {"before": a.before or before_dir(a.before_commit), "after": ROOT}
    load0 = os.getloadavg()
    drivers = {k: Driver(p, a.steps) for k, p in paths.items()}
    try:
        if a.profile:
            for k, d in drivers.items():
                print(f"== {k} ({d.labkit}), rank 0, {a.steps} steps\n{d.ask('profile')['table']}")
            return
        runs: dict = {"before": [], "after": []}
        loads = [load0[0]]
        for _ in range(a.rounds):
            for k in ("before", "after", "after", "before"):
                runs[k].append(drivers[k].ask("run"))
            loads.append(os.getloadavg()[0])
    finally:
        for d in drivers.values():
            d.close()
    out = {}
    for kind in ("wall", "cpu"):
        b = [r[kind] for r in runs["before"]]
        f = [r[kind] for r in runs["after"]]
        pairs = [(f[2 * i] + f[2 * i + 1]) / (b[2 * i] + b[2 * i + 1]) for i in range(a.rounds)]
        out[kind] = (statistics.median(b), statistics.median(f), quartiles(pairs))
    print(f"tiny TP2+SP bf16, 2 CPU ranks x 1 thread; {a.rounds} rounds A B B A, "
          f"{a.steps - 2} timed steps a run, {2 * a.rounds} runs an arm")
    print(f"before: {paths['before']}\nafter:  {paths['after']}")
    print(f"{'per step':<10}{'before ms':>11}{'after ms':>10}{'ratio':>8}"
          f"{'round ratios q1/median/q3':>30}")
    for kind, (b, f, (q1, q2, q3)) in out.items():
        print(f"{kind:<10}{b * 1e3:>11.2f}{f * 1e3:>10.2f}{f / b:>8.3f}"
              f"{q1:>14.3f}{q2:>8.3f}{q3:>8.3f}")
    print(f"load average (1 min) over the rounds: min {min(loads):.1f}, median "
          f"{statistics.median(loads):.1f}, max {max(loads):.1f} on {os.cpu_count()} cores")
    (b, f, _), (cb, cf, _) = out["wall"], out["cpu"]
    print(f"RESULT sp_step_time before_ms={b * 1e3:.3f} after_ms={f * 1e3:.3f} "
          f"ratio={f / b:.4f} cpu_ratio={cf / cb:.4f} load={statistics.median(loads):.1f}")


if __name__ == "__main__":
    main()
