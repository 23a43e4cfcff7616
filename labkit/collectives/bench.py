"""``labkit bench collectives``: time, algbw and busbw of native and hand-built collectives.

Definitions are nccl-tests' (``doc/PERFORMANCE.md``): for a message of ``S`` bytes taking
``t`` seconds, **algbw = S / t** and **busbw = algbw × factor** with factor 2(N−1)/N for
all-reduce, (N−1)/N for reduce-scatter, all-gather and all-to-all, and 1 for broadcast and
reduce (:func:`labkit.collectives.busbw_factor`). busbw is what the slowest link carried,
so it is comparable across N and against a link's peak. GB/s are 10^9 bytes per second.

Method: per world size one job runs every size and algorithm on the warm cluster. Each
(size, algorithm) is timed in ``rounds`` interleaved rounds (native then hand-built, then
the other way round, …, so background load hits both alike); a round is ``warmup`` untimed
calls, then ``iters`` calls, each started right after a barrier and timed on every rank.
A call's time is its slowest rank's; the reported time is the median over all calls of all
rounds. Per-step records are off (no recorder) and tracing is paused, so the hand-built
algorithms pay only for their messages and reductions. :func:`ratios` also gives a 90 %
bootstrap interval over the rounds: this run's sampling noise. Background load that changes
between runs moves the ratio further (±30 % between runs on a shared 2-core machine).

gloo may implement a collective with other algorithms internally (pytorch/pytorch#149869):
the native numbers are gloo's timing, while bytes elsewhere in labkit are algorithmic. Its CPU
all-reduce (``gloo::allreduce``, as built into torch 2.13) is itself a ring of 1 MiB
segments, so native and hand-built all-reduce move the same bytes at every N.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .. import comm
from . import HAND_BUILT, OPS, busbw_factor, check_algorithm
from .bench_report import figure, fmt_size, ratio_interval, ratios, table

__all__ = ["BenchConfig", "timing_job", "run_bench", "ratios", "ratio_interval", "table",
           "figure", "memcpy_bandwidth", "default_sizes", "parse_size", "add_arguments", "main"]

KiB, MiB = 1024, 1024 ** 2
GOAL_RATIO, GOAL_MIN_BYTES = 0.8, 16 * MiB


def default_sizes(lo: int = KiB, hi: int = 64 * MiB, factor: int = 4) -> tuple:
    """``lo, lo·factor, …`` up to ``hi`` bytes (1 KiB … 64 MiB in powers of 4).

    Raises:
        ValueError: ``lo < 1`` or ``factor < 2`` (the sequence would never pass ``hi``).
    """
    if lo < 1 or factor < 2:
        raise ValueError(f"need lo >= 1 and factor >= 2, got lo={lo}, factor={factor}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return tuple(out)


def parse_size(text: str) -> int:
    """``"1K"``, ``"64MiB"``, ``"1048576"`` → bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", str(text), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1K, 16MiB or 65536)")
    return int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1024 ** 3}[m.group(2).lower()]


def iterations(nbytes: int) -> int:
    """Timed calls per round: about 32 MiB of payload, between 3 and 20 calls."""
    return max(3, min(20, (32 * MiB) // max(nbytes, 1)))


@dataclass(frozen=True)
class BenchConfig:
    """What :func:`timing_job` times: ``op`` with each of ``algorithms`` at each size (bytes,
    S as nccl-tests counts it), ``rounds`` interleaved rounds of ``iters`` calls (None =
    :func:`iterations`)."""

    op: str = "all_reduce"
    sizes: tuple = default_sizes()
    algorithms: tuple = ("native", "ring")
    dtype: str = "float32"
    rounds: int = 5
    warmup: int = 1
    iters: Optional[int] = None
    timeout_s: float = 900.0

    def validate(self, world_size: int) -> "BenchConfig":
        for a in self.algorithms:
            check_algorithm(self.op, a)
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"sizes must be positive byte counts, got {self.sizes}")
        if self.rounds < 1 or (self.iters is not None and self.iters < 1):
            raise ValueError("rounds and iters must be at least 1")
        return self


def _call(op: str, algorithm: str, bufs: dict, group):
    """A no-argument callable running one ``op`` in place on ``bufs`` (no copies, no
    recorder: what the benchmark times)."""
    from . import pairwise, ring, tree

    x, out, root = bufs["x"], bufs["out"], comm.group_ranks(group)[0]
    return {
        ("all_reduce", "native"): lambda: comm.all_reduce(x, "sum", group),
        ("all_reduce", "ring"): lambda: ring.all_reduce(x, "sum", group),
        ("all_reduce", "recursive_doubling"):
            lambda: tree.all_reduce_recursive_doubling(x, "sum", group),
        ("reduce_scatter", "native"): lambda: comm.reduce_scatter(out, x, "sum", group),
        ("reduce_scatter", "ring"): lambda: ring.reduce_scatter(out, x, "sum", group),
        ("all_gather", "native"): lambda: comm.all_gather(out, x, group),
        ("all_gather", "ring"): lambda: ring.all_gather(out, x, group),
        ("all_to_all", "native"): lambda: comm.all_to_all(out, x, group),
        ("all_to_all", "pairwise"): lambda: pairwise.all_to_all(out, x, group),
        ("broadcast", "native"): lambda: comm.broadcast(x, root, group),
        ("broadcast", "tree"): lambda: tree.broadcast(x, root, group),
        ("reduce", "native"): lambda: comm.reduce(x, root, "sum", group),
        ("reduce", "tree"): lambda: tree.reduce(x, root, "sum", group),
    }[(op, algorithm)]


def _buffers(op: str, nbytes: int, n: int, dtype, device) -> dict:
    """Zero-filled buffers (sums of zeros stay finite however often they run)."""
    numel = max(n, nbytes // torch.tensor([], dtype=dtype).element_size() // n * n)
    z = lambda k: torch.zeros(k, dtype=dtype, device=device)  # noqa: E731
    if op == "reduce_scatter":
        return {"x": z(numel), "out": z(numel // n)}
    if op == "all_gather":
        return {"x": z(numel // n), "out": z(numel)}
    return {"x": z(numel), "out": z(numel)}


def timing_job(ctx, cfg: BenchConfig) -> list:
    """Job: one dict ``{"bytes", "algorithm", "round", "call", "time_s"}`` per timed call
    (each call starts right after a barrier, so every rank times the same call)."""
    from .jobs import DTYPES

    dtype = DTYPES[cfg.dtype]
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    ctx.tracer.enabled = False  # no per-call event bookkeeping inside the timed loops
    rows = []
    try:
        for nbytes in cfg.sizes:
            bufs = _buffers(cfg.op, nbytes, ctx.world_size, dtype, ctx.device)
            iters = cfg.iters or iterations(nbytes)
            calls = {a: _call(cfg.op, a, bufs, ctx.group) for a in cfg.algorithms}
            for rnd in range(cfg.rounds):
                order = list(calls.items())
                for algorithm, fn in (order if rnd % 2 == 0 else order[::-1]):
                    for _ in range(cfg.warmup):
                        fn()
                    for i in range(iters):
                        sync()
                        comm.barrier(ctx.group)
                        t0 = time.perf_counter()
                        fn()
                        sync()
                        rows.append({"bytes": nbytes, "algorithm": algorithm, "round": rnd,
                                     "call": i, "time_s": time.perf_counter() - t0})
            del bufs, calls
    finally:
        ctx.tracer.enabled = True
    return rows


def run_bench(cluster, op: str = "all_reduce", world_sizes: Sequence[int] = (2, 4),
              sizes: Sequence[int] = default_sizes(), algorithms: Optional[Sequence[str]] = None,
              rounds: int = 5, iters: Optional[int] = None, dtype: str = "float32") -> list:
    """Time ``op`` on a warm ``cluster`` for each world size (``nranks=N``).

    Returns rows ``{"op", "algorithm", "n", "bytes", "time_s", "algbw", "busbw", "calls"}``
    with bandwidths in GB/s (10^9 B/s) and ``calls`` the ``[round, seconds]`` of every timed
    call. Raises ``ValueError`` for a bad op, algorithm or size.
    """
    algorithms = tuple(algorithms or ("native", HAND_BUILT[op]))
    cfg = BenchConfig(op, tuple(sizes), algorithms, dtype, rounds, 1, iters)
    out = []
    for n in world_sizes:
        if not 1 <= n <= cluster.world_size:
            raise ValueError(f"world size {n} does not fit the cluster of {cluster.world_size}")
        res = cluster.run(timing_job, cfg.validate(cluster.world_size), nranks=n)
        slowest: dict = {}  # (bytes, algorithm, round, call) -> the slowest rank's time
        for rows in res.outputs:
            for r in rows:
                key = (r["bytes"], r["algorithm"], r["round"], r["call"])
                slowest[key] = max(slowest.get(key, 0.0), r["time_s"])
        per_point: dict = {}
        for key, t in slowest.items():
            per_point.setdefault(key[:2], []).append([key[2], t])
        for (nbytes, algorithm), calls in sorted(per_point.items()):
            t = statistics.median(c[1] for c in calls)
            algbw = nbytes / t / 1e9
            out.append({"op": op, "algorithm": algorithm, "n": n, "bytes": nbytes, "time_s": t,
                        "algbw": algbw, "busbw": algbw * busbw_factor(op, n), "calls": calls})
    return out


def memcpy_bandwidth(nbytes: int = 64 * MiB, repeats: int = 5) -> float:
    """GB/s of a large tensor copy in this process, counting read + write (2·S per copy),
    the way a memory bandwidth such as H100's 3352 GB/s HBM figure counts traffic."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


# --------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``labkit bench collectives``."""
    p.add_argument("--world-size", type=int, action="append", dest="world_sizes",
                   metavar="N", help="ranks (repeatable; default 2 and 4)")
    p.add_argument("--op", default="all_reduce", choices=OPS + ("all",))
    p.add_argument("--algorithm", action="append", dest="algorithms", metavar="ALG",
                   help="repeatable; default native and the op's hand-built algorithm")
    p.add_argument("--min-size", type=parse_size, default=KiB, help="default 1KiB")
    p.add_argument("--max-size", type=parse_size, default=64 * MiB, help="default 64MiB")
    p.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    p.add_argument("--iters", type=int, default=None, help="calls per round (default: auto)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "int32",
                                                          "int64"))
    p.add_argument("--html", metavar="PATH", help="write the plotly figure as HTML")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    """Run the sweep, print a table and ``RESULT`` lines; 0 on success, 2 on bad input.

    For all-reduce: ``RESULT ring_vs_native_busbw_<size> <ratio>`` for every size ≥ 16 MiB
    (the lowest ratio over the world sizes), one line per N, their intervals and the goal."""
    from rich.console import Console

    from ..cluster import Cluster

    from ..preflight import check_output_path, check_world_size

    world_sizes = sorted(set(args.world_sizes or (2, 4)))
    ops = OPS if args.op == "all" else (args.op,)
    try:
        if args.factor < 2:
            raise ValueError(f"--factor must be >= 2, got {args.factor}")
        if not 1 <= args.min_size <= args.max_size:
            raise ValueError(f"need 1 <= --min-size <= --max-size, got {args.min_size} and "
                             f"{args.max_size} bytes")
        if min(world_sizes) < 2:
            raise ValueError(f"--world-size must be >= 2 (a collective needs two ranks to "
                             f"move anything), got {min(world_sizes)}")
        check_world_size(max(world_sizes), "--world-size")
        if args.rounds < 1 or (args.iters is not None and args.iters < 1):
            raise ValueError(f"--rounds and --iters must be >= 1, got --rounds {args.rounds}"
                             f", --iters {'auto' if args.iters is None else args.iters}")
        check_output_path(args.json, "--json")
        check_output_path(args.html, "--html")
        for op in ops:
            for a in args.algorithms or ():
                check_algorithm(op, a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = default_sizes(args.min_size, args.max_size, args.factor)
    if max(world_sizes) > (os.cpu_count() or 1):
        print(f"note: {max(world_sizes)} ranks on {os.cpu_count()} cores share CPUs; "
              "timings are contended", file=sys.stderr)
    console, all_rows = Console(width=None if sys.stdout.isatty() else 120), []
    with Cluster(max(world_sizes), backend="gloo", device="cpu") as cluster:
        for op in ops:
            rows = run_bench(cluster, op, world_sizes, sizes, args.algorithms, args.rounds,
                             args.iters, args.dtype)
            console.print(table(rows))
            all_rows += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)
    if args.html:
        figure(all_rows).write_html(args.html, include_plotlyjs="cdn")
    _result_lines([r for r in all_rows if r["op"] == "all_reduce"])
    return 0


def _result_lines(rows: Sequence[dict]) -> None:
    rs = ratios(rows, "ring", GOAL_MIN_BYTES) if rows else []
    for b in sorted({r["bytes"] for r in rs}):
        at, name = [r for r in rs if r["bytes"] == b], fmt_size(b).replace(" ", "")
        print(f"RESULT ring_vs_native_busbw_{name} {min(r['ratio'] for r in at):.3f}")
        for r in at:
            print(f"RESULT ring_vs_native_busbw_{name}_N{r['n']} {r['ratio']:.3f}")
    for r in (r for r in rs if "lo" in r):
        print(f"  N={r['n']} {fmt_size(r['bytes'])}: ring/native {r['ratio']:.2f}, 90% interval "
              f"over rounds [{r['lo']:.2f}, {r['hi']:.2f}]")
    if rs:
        w = min(rs, key=lambda r: r["ratio"])
        noisy = w.get("lo", 1) < GOAL_RATIO <= w.get("hi", 0)
        print(f"goal: hand-built ring >= {GOAL_RATIO}x native busbw at >= 16 MiB: "
              f"{'met' if w['ratio'] >= GOAL_RATIO else 'NOT met'} (lowest {w['ratio']:.3f}"
              f"{', within this run’s noise of the goal' if noisy else ''})")
