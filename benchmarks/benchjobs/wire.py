"""Job for ``benchmarks/native_wire_bytes.py``: loopback byte counters around native
collectives."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit import comm

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def lo_tx_bytes() -> int:
    """Bytes the loopback interface has transmitted (``/proc/net/dev``), all processes."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _call(op: str, x: torch.Tensor, out: torch.Tensor, group) -> None:
    if op == "all_reduce":
        comm.all_reduce(x, group=group)
    elif op == "reduce_scatter":
        comm.reduce_scatter(out, x, group=group)
    else:
        comm.all_gather(out, x, group=group)


def wire_bytes(ctx, cfg: dict) -> list:
    """For each op: loopback bytes around ``reps`` calls on ``nbytes`` tensors, and around an
    idle window of the same length (the machine's other loopback traffic). Rank 0 reads."""
    n, reps, s = ctx.world_size, cfg["reps"], cfg["nbytes"]
    rows = []
    for op in OPS:
        if op == "all_gather":
            x, out = torch.ones(s // 4 // n), torch.empty(s // 4)
        else:
            x, out = torch.ones(s // 4), torch.empty(s // 4 // n)
        _call(op, x, out, ctx.group)  # warm up connections and buffers
        dist.barrier(ctx.group)
        t0, b0 = time.perf_counter(), lo_tx_bytes()
        for _ in range(reps):
            _call(op, x, out, ctx.group)
        dist.barrier(ctx.group)
        dt, busy = time.perf_counter() - t0, lo_tx_bytes() - b0
        b1 = lo_tx_bytes()
        time.sleep(dt)
        idle = lo_tx_bytes() - b1
        dist.barrier(ctx.group)
        formula = {"all_reduce": 2 * (n - 1) / n * s}.get(op, (n - 1) / n * s)
        rows.append({"op": op, "n": n, "nbytes": s, "reps": reps, "busy": busy, "idle": idle,
                     "formula_per_rank": formula})
    return rows
