"""Jobs for tests/test_comm_bytes.py: one call of every labkit.comm entry point, and a
hand-built ring all-reduce. Importable by the ranks (tests/ is on their sys.path)."""
from __future__ import annotations

import torch

from labkit import comm
from labkit.collectives.jobs import execute
from labkit.trace import region


def every_call(ctx, cfg=None) -> None:
    """Each native collective, each point-to-point form, and labkit's ring all-reduce,
    once, on a 2-rank group (the trace is what the test reads)."""
    g, r = ctx.group, ctx.rank
    other = 1 - r
    x = torch.arange(4.0) + r
    comm.all_reduce(x.clone(), group=g)
    comm.all_reduce(x.clone(), op="avg", group=g, async_op=True).wait()
    comm.reduce_scatter(torch.empty(2), x.clone(), group=g)
    comm.all_gather(torch.empty(8), x.clone(), group=g)
    comm.all_to_all(torch.empty(4), x.clone(), group=g)
    comm.all_to_all_list([torch.empty(2), torch.empty(2)], [x[:2].clone(), x[2:].clone()], g)
    comm.broadcast(x.clone(), 0, g)
    comm.reduce(x.clone(), 0, group=g)
    if r == 0:
        comm.send(x.clone(), other, g)
    else:
        comm.recv(torch.empty(4), other, g)
    h = comm.isend(x.clone(), other, g) if r == 0 else comm.irecv(torch.empty(4), other, g)
    h.wait()
    for h in comm.batch_isend_irecv([(x.clone(), other)], [(torch.empty(4), other)], g):
        h.wait()
    with region("ring all-reduce"):
        execute("all_reduce", "ring", x.clone(), g)
