"""``labkit run | plan | bench``: the notebook's jobs from a terminal, or under torchrun.

* ``labkit run --dp 2 --steps 5 --model tiny`` starts its own :class:`labkit.Cluster`,
  runs :func:`labkit.jobs.train` and prints one row per rank: step time, MFU, model-state
  memory measured beside :mod:`labkit.plan`, all-reduce bytes beside 2(N−1)/N·|θ|·4.
* ``labkit run --dp 4 --zero 3 --steps 3 --model tiny`` (``--zero 0|1|2``,
  ``--hsdp-replicas M``, ``--no-prefetch``) runs :func:`labkit.parallel.zero_jobs.zero_train`
  and prints memory by category and bytes per collective, measured beside predicted
  (:mod:`labkit.cli_report`).
* ``labkit run --pp 4 --microbatches 8 --schedule 1f1b`` (:mod:`labkit.cli_pipeline`): bubble
  measured beside simulated, memory and MFU per rank; not with ``--dp > 1``/``--zero`` yet.
* ``torchrun --nproc-per-node 2 -m labkit run --dp 2 ...`` runs the same job in-process on
  each torchrun worker (env:// rendezvous), gathers every rank's output to rank 0 and
  prints the same table there.
* ``labkit plan memory --params 7.5e9 --ranks 64 --zero 3``: model-state bytes per rank;
  ``labkit plan layout ...`` one layout at cluster scale, ``labkit plan search ...`` the best
  layouts that fit (:mod:`labkit.plan.cli`).
* ``labkit bench collectives ...``: provided by :mod:`labkit.collectives.bench`.

Bad input is a one-line ``error: ...`` and exit code 2, before any process starts.
Only the config module is imported before validation: torch loads after it.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Optional, Sequence

from . import cli_pipeline
from .preflight import check_output_path, check_run_fits
from .cli_report import render_run, report, run_json
from .plan.cli import add_plan_parser

__all__ = ["main", "build_parser", "render_run", "run_json", "under_torchrun"]

_BENCH_MODULE = "labkit.collectives.bench"


class UsageError(Exception):
    """Bad input: printed as ``error: ...``, exit code 2."""


# --------------------------------------------------------------------------- parser
def build_parser(bench_collectives=None) -> argparse.ArgumentParser:
    """The argument parser; ``bench_collectives`` is the imported bench module, if any."""
    from . import __version__

    p = argparse.ArgumentParser(prog="labkit", description="labkit: run, plan and benchmark "
                                "distributed training on a local cluster or under torchrun.")
    p.add_argument("--version", action="version", version=f"labkit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{run,plan,bench}", required=True)

    r = sub.add_parser("run", help="train data-, ZeRO- or pipeline-parallel; per-rank metrics",
                       description="Train on --dp or --pp ranks (own local cluster, or torchrun's "
                       "workers under torchrun) and print measured vs predicted.")
    r.add_argument("--dp", type=int, default=None,
                   help="data-parallel ranks (default 1; WORLD_SIZE under torchrun)")
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--model", default="tiny", help="model preset (tiny, small, gpt2-124m, ...)")
    r.add_argument("--global-batch", type=int, default=8)
    r.add_argument("--micro-batch", type=int, default=None,
                   help="samples per forward/backward (default: the whole local batch)")
    r.add_argument("--dp-mode", default="ddp", choices=("ddp", "naive", "torch"))
    r.add_argument("--bucket-mb", type=float, default=25.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--zero", type=int, default=None, metavar="{0,1,2,3}",
                   help="run the ZeRO job at this stage (0 DP, 1 optimizer state sharded, "
                   "2 + gradients, 3 + parameters = FSDP)")
    r.add_argument("--hsdp-replicas", type=int, default=1, metavar="M",
                   help="HSDP: M replica groups of dp/M shards (ZeRO stages 1-3; default 1)")
    r.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="ZeRO-3: do not prefetch the next unit's all-gather")
    r.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON")
    r.add_argument("--json", action="store_true", help="print metrics as JSON, not a table")
    cli_pipeline.add_arguments(r)
    r.set_defaults(func=cmd_run)

    add_plan_parser(sub)  # labkit.plan.cli: memory, layout, search, validate, presets

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="what", metavar="{collectives}", required=True)
    c = bsub.add_parser("collectives", help="collective bandwidth (algbw/busbw) sweep")
    if bench_collectives is not None:
        bench_collectives.add_arguments(c)
        c.set_defaults(func=lambda args: bench_collectives.main(args))
    else:
        c.set_defaults(func=lambda args: _bench_unavailable())
    return p


def _load_bench_collectives():
    try:
        return importlib.import_module(_BENCH_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name in ("labkit.collectives", _BENCH_MODULE):
            return None
        raise


def _bench_unavailable() -> int:
    print("labkit bench collectives is not available in this build", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- run
def under_torchrun(env=os.environ) -> bool:
    """True inside a worker started by torchrun / torch.distributed.run."""
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)


def _run_config(args, world_size: int):
    """The Run/Zero/PipelineConfig the arguments describe, validated for ``world_size``."""
    from .config import PRESETS, RunConfig

    if args.trace is not None and not args.trace.strip():
        raise UsageError("--trace needs a file name, got an empty one")
    try:
        check_output_path(args.trace, "--trace")
        if cli_pipeline.wants_pipeline(args):
            return _fits(cli_pipeline.pipeline_config(args, world_size))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    dp = args.dp
    if dp is None or dp < 1:
        raise UsageError(f"dp must be a positive int, got {dp}")
    if args.global_batch < 1:
        raise UsageError(f"global_batch must be a positive int, got {args.global_batch}")
    if args.global_batch % dp:
        raise UsageError(f"global_batch={args.global_batch} is not divisible by dp={dp} "
                         f"(each rank takes global_batch/dp samples)")
    cfg = RunConfig(model=args.model, steps=args.steps, global_batch=args.global_batch,
                    micro_batch=args.micro_batch, dp_mode=args.dp_mode,
                    bucket_mb=args.bucket_mb, seed=args.seed, lr=args.lr,
                    dataset="digits" if getattr(PRESETS.get(args.model), "kind", "") == "vit"
                    else "text").replace(dp=dp)
    if not args.prefetch and args.zero != 3:
        raise UsageError(f"--no-prefetch is for ZeRO-3's all-gathers (--zero 3); "
                         f"{'--zero ' + str(args.zero) if args.zero is not None else 'plain DP'}"
                         " gathers no parameters")
    if args.zero is not None or args.hsdp_replicas != 1:
        from .parallel.zero_config import ZeroConfig

        if args.dp_mode != "ddp":
            raise UsageError(f"--dp-mode {args.dp_mode} is for the plain DP job; the ZeRO "
                             f"job (--zero {args.zero}) syncs with its own collectives")
        cfg = ZeroConfig(run=cfg, zero_stage=0 if args.zero is None else args.zero,
                         prefetch=args.prefetch, hsdp_replicas=args.hsdp_replicas)
    try:
        return _fits(cfg.validate(world_size))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _fits(cfg):
    """``cfg`` once :func:`~labkit.preflight.check_run_fits` passes; under torchrun the
    launcher has placed the processes (maybe on several nodes), so nothing is checked."""
    if not under_torchrun():
        check_run_fits(cfg)
    return cfg


def _job(cfg):
    """The job for ``cfg``: the pipeline's, ZeRO's ``zero_train`` or ``labkit.train.run``."""
    if hasattr(cfg, "schedule"):
        from .parallel.pipeline.lab import pipeline_train_mfu

        return pipeline_train_mfu
    if hasattr(cfg, "zero_stage"):
        from .parallel.zero_jobs import zero_train

        return zero_train
    from .train import run

    return run


def cmd_run(args) -> int:
    if under_torchrun():
        return _run_torchrun(args)
    if args.dp is None and not cli_pipeline.wants_pipeline(args):
        args.dp = 1
    cfg = _run_config(args, args.pp or args.dp)
    from .cluster import Cluster, RankError

    t0 = time.perf_counter()
    try:
        with Cluster(world_size=cfg.parallel.world_size) as cluster:
            result = cluster.run(_job(cfg), cfg)
            backend = cluster.backend
    except (RankError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    info = {"launcher": "cluster", "backend": backend, "wall_s": time.perf_counter() - t0}
    if args.trace:
        result.trace.to_chrome(args.trace)
        info["trace"] = args.trace
    report(cfg, result.outputs, info, args.json, result.trace)
    return 0


def _run_torchrun(args) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = os.environ.get("RANK", "0") == "0"
    pipe = cli_pipeline.wants_pipeline(args)
    if args.dp is None and not pipe:
        args.dp = world
    try:
        flag, n = ("--pp", args.pp) if pipe else ("--dp", args.dp)
        if n is not None and n != world:
            raise UsageError(f"{flag}={n} must equal torchrun's WORLD_SIZE={world} "
                             f"(nnodes x nproc-per-node)")
        cfg = _run_config(args, world)
    except UsageError as exc:
        if rank0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if os.environ.get("MASTER_ADDR", "") in ("localhost", "127.0.0.1", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # pair sockets on loopback too
    import torch.distributed as dist

    from .trace import Trace, use_tracer
    from .worker import context_from_env

    t0 = time.perf_counter()
    ctx = context_from_env()
    try:
        with use_tracer(ctx.tracer):
            out = _job(cfg)(ctx, cfg)
        mine = {"output": out, "events": ctx.tracer.events if args.trace or pipe else []}
        gathered = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=ctx.group)
        if ctx.rank == 0:
            info = {"launcher": "torchrun", "backend": ctx.backend,
                    "wall_s": time.perf_counter() - t0}
            trace = Trace.merge(g["events"] for g in gathered)
            if args.trace:
                trace.to_chrome(args.trace)
                info["trace"] = args.trace
            report(cfg, [g["output"] for g in gathered], info, args.json, trace)
        dist.barrier(group=ctx.group)  # nobody tears gloo down while rank 0 still receives
    finally:
        dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``labkit`` console script; returns the exit code.

    Run as a script under torchrun (``argv`` None), a rank ends with ``os._exit`` once its
    output is flushed: the process group is already destroyed, and skipping the
    interpreter's teardown avoids an abort ("terminate called without an active
    exception", SIGABRT) that gloo's C++ threads cause there in a few percent of runs.
    """
    rc = _main(argv)
    if argv is None and under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _main(argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv if not a.startswith("-")]
    bench = _load_bench_collectives() if words[:2] == ["bench", "collectives"] else None
    if words[:2] == ["bench", "collectives"] and bench is None:
        return _bench_unavailable()
    args = build_parser(bench).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
