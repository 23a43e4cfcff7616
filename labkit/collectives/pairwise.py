"""All-to-all by pairwise exchange: the distributed transpose.

Rank i's input is N chunks; chunk j is meant for rank j. Afterwards rank j's output chunk i
is rank i's input chunk j — the (rank × chunk) matrix is transposed across ranks. This is
the data movement behind Ulysses sequence parallelism and MoE token dispatch.

Algorithm (Thakur, Rabenseifner & Gropp, IJHPCA 2005, §3.5 "pairwise exchange"): rank r
copies its own chunk locally, then runs N−1 steps. At step k (1 … N−1) it exchanges
with one partner: when N is a power of two, partner r XOR k both ways; otherwise it sends
to (r+k) mod N and receives from (r−k) mod N. Every rank sends and receives exactly one
chunk per step, so no link is oversubscribed and no step waits on another pair.

Bytes per rank, each way: (N−1)/N · S, S = this rank's whole input (the local chunk moves
no bytes).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from . import check_divisible
from .record import Recorder

__all__ = ["all_to_all", "partners"]


def partners(rank: int, n: int, k: int) -> tuple[int, int]:
    """``(send_to, recv_from)`` of ``rank`` at step ``k`` (1 ≤ k < n)."""
    if n & (n - 1) == 0:
        return rank ^ k, rank ^ k
    return (rank + k) % n, (rank - k) % n


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
               recorder: Optional[Recorder] = None) -> torch.Tensor:
    """Pairwise-exchange all-to-all: chunk j of ``input`` (dim 0 cut in N equal parts) goes
    to group rank j; chunk i of ``output`` (same shape as ``input``) comes from rank i.

    Raises:
        ValueError: dim 0 of ``input`` does not divide by N (the message says how to pad),
            or ``output`` has a different number of elements.
    """
    ranks = comm.group_ranks(group)
    n, me = len(ranks), dist.get_rank(group)
    rows = input.shape[0] if input.dim() else 1
    check_divisible(rows, n, "pairwise all_to_all (dim 0 of the input)")
    if output.numel() != input.numel():
        raise ValueError(f"pairwise all_to_all: output has {output.numel()} elements, "
                         f"input {input.numel()}; they must match")
    k = input.numel() // n
    src = input.reshape(-1)
    if not src.is_contiguous():
        src = src.contiguous()
    work = output.view(-1) if output.is_contiguous() else torch.empty(
        n * k, dtype=output.dtype, device=output.device)
    ins = [src[i * k:(i + 1) * k] for i in range(n)]
    outs = [work[i * k:(i + 1) * k] for i in range(n)]
    filled = {me}
    if recorder is not None:
        recorder.inputs(ins, separate_output=True)
        recorder.end_step(0, [None] * n, "start")
    outs[me].copy_(ins[me])
    for step in range(1, n):
        to, frm = partners(me, n, step)
        for h in comm.batch_isend_irecv([(ins[to], ranks[to])], [(outs[frm], ranks[frm])],
                                        group=group):
            h.wait()
        filled.add(frm)
        if recorder is not None:
            if step == 1:
                recorder.recv(1, me, me, 0, "local", phase="exchange", from_input=True)
            recorder.recv(step, frm, frm, comm.nbytes(outs[frm]), "copy", src_chunk=me,
                          phase="exchange", from_input=True)
            recorder.end_step(step, [o if i in filled else None for i, o in enumerate(outs)],
                              "exchange")
    if n == 1 and recorder is not None:
        recorder.recv(1, me, me, 0, "local", phase="exchange", from_input=True)
        recorder.end_step(1, outs, "exchange")
    if work.data_ptr() != output.data_ptr():
        output.copy_(work.view(output.shape))
    return output
