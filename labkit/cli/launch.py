"""``labkit run``: the one training job on an own local cluster, or in torchrun's workers.

* **Own cluster.** :func:`~.run.resolve` validates the flags, then a
  :class:`labkit.Cluster` of ``dp·tp·pp·cp`` ranks runs :func:`labkit.jobs.train` and the
  caller prints the report.
* **Under torchrun** (``torchrun --nproc-per-node N -m labkit run ...``), every worker
  validates the same flags (rank 0 prints a refusal, all exit 2), joins the process group
  from the environment (``env://``), runs the job in-process, and sends its output (and its
  trace events when a trace or the bubble needs them) to rank 0 with ``gather_object``;
  rank 0 prints the report; a barrier keeps every rank's gloo alive until rank 0 has
  received everything; then the group is destroyed.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from .common import UsageError, under_torchrun
from .run import resolve

__all__ = ["cmd_run"]


def cmd_run(args) -> int:
    """Run ``labkit run``'s arguments; returns the exit code (1: a rank failed or hung)."""
    if under_torchrun():
        return _run_torchrun(args)
    r = resolve(args)
    from ..cluster import Cluster, RankError
    from ..jobs import train
    from .report import report

    t0 = time.perf_counter()
    faults: list = []
    try:
        from ..nodes import DEFAULT_INTER_NODE

        nodes = {} if args.nodes == 1 else {
            "nodes": args.nodes, "inter_node": args.inter_node or DEFAULT_INTER_NODE,
            "latency_ms": args.latency_ms}
        with Cluster(world_size=r.world_size, **nodes) as cluster:
            net = getattr(cluster, "network", None)
            before = net.link_bytes() if net is not None else None
            if r.cfg.faults:  # injected: detect, restart once, run again without them
                from ..faults.recover import run_resilient

                def said(cost, exc) -> None:
                    faults.append(cost)  # its lost work is filled in at the end
                    print(f"fault detected: {str(exc).strip().splitlines()[0]}; pool "
                          f"restarted in {cost.recovery_s:.1f} s, running again",
                          file=sys.stderr)

                result = run_resilient(cluster, r.cfg, train, max_restarts=1,
                                       on_fault=said,  # from the last snapshot if saving
                                       resume=bool(r.cfg.save_dir and r.cfg.save_every)
                                       ).result
            else:
                result = cluster.run(train, r.cfg)
            backend = cluster.backend
            if net is not None:
                after = net.link_bytes()
                r.notes["nodes"] = {"nodes": cluster.nodes, "inter_node_Bps": cluster.inter_node,
                                    "link_bytes": {k: after[k] - before[k] for k in after},
                                    "describe": net.describe()}
    except (RankError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    info = {"launcher": "cluster", "backend": backend, "wall_s": time.perf_counter() - t0,
            **r.notes}
    if r.cfg.faults:
        from ..faults.straggler import stragglers

        info["faults"] = [dataclasses.asdict(c) for c in faults]
        info["stragglers"] = str(stragglers(result.trace, from_step=1))
    sdc = [e["text"] for e in result.metrics[0].get("sdc", {}).get("events", [])]
    if sdc:
        info["silent_data_corruption"] = sdc
    if args.trace:
        result.trace.to_chrome(args.trace)
        info["trace"] = args.trace
    report(r.cfg, result.outputs, info, args.json, result.trace)
    return 0


def _run_torchrun(args) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        r = resolve(args, torchrun_world=world, check_machine=False)
    except UsageError as exc:
        if rank0:
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if os.environ.get("MASTER_ADDR", "") in ("localhost", "127.0.0.1", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # pair sockets on loopback too
    import torch.distributed as dist

    from ..jobs import train
    from ..trace import Trace, use_tracer
    from ..worker import context_from_env

    t0 = time.perf_counter()
    ctx = context_from_env()
    try:
        with use_tracer(ctx.tracer):
            out = train(ctx, r.cfg)
        events = args.trace or r.cfg.parallel.pp > 1  # the bubble is read from the trace
        mine = {"output": out, "events": ctx.tracer.snapshot() if events else []}
        gathered = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=ctx.group)
        if ctx.rank == 0:
            from .report import report

            info = {"launcher": "torchrun", "backend": ctx.backend,
                    "wall_s": time.perf_counter() - t0, **r.notes}
            trace = Trace.merge(g["events"] for g in gathered)
            if args.trace:
                trace.to_chrome(args.trace)
                info["trace"] = args.trace
            report(r.cfg, [g["output"] for g in gathered], info, args.json, trace)
        dist.barrier(group=ctx.group)  # nobody tears gloo down while rank 0 still receives
    finally:
        dist.destroy_process_group()
    return 0
