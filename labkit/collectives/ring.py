"""Ring reduce-scatter, ring all-gather, and the ring all-reduce made of the two.

The bandwidth-optimal algorithm of Patarasuk & Yuan ("Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 69(2), 2009, §3), the one NCCL and gloo
use for large messages. The N ranks form a ring; each rank's buffer of ``S`` bytes is cut
into N chunks of S/N bytes.

* **Reduce-scatter**, N−1 steps: at step s (0-based) rank r sends chunk (r−s−1) mod N to
  rank r+1 and adds the chunk (r−s−2) mod N it receives from rank r−1 into its own copy.
  Chunk c starts at rank c+1 and travels once round the ring collecting every rank's
  contribution, so after the last step rank r holds the fully reduced chunk r.
* **All-gather**, N−1 steps: rank r starts with (reduced) chunk r; at step s it sends
  chunk (r−s) mod N to r+1 and stores chunk (r−s−1) mod N from r−1.
* **All-reduce** = reduce-scatter then all-gather (the lectures' identity).

Bytes per rank, each way, as :mod:`labkit.comm` counts them: (N−1)·S/N for reduce-scatter
(S = the full input) and all-gather (S = the full output), 2(N−1)·S/N for all-reduce.

Every message goes through :func:`labkit.comm.isend` / :func:`labkit.comm.irecv`, which
trace it and count its bytes. The ring is pipelined the way gloo's own ring is: each step's
chunk travels as up to ``PIPELINE`` pieces of at least ``PIPELINE_MIN_BYTES``, the
receives of step s+1 are posted before step s is reduced, and a piece is passed on as soon
as it has been reduced, so adding one piece overlaps receiving the next and no step waits
for a whole chunk. Received data lands in two reused scratch buffers of S/N bytes (kept per
dtype for the process's lifetime) and is added in place, so large messages allocate nothing
per call. With a recorder the steps run one at a time, whole chunks, so every snapshot is
exactly the state after its step.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from . import check_divisible, check_reduce, combine_
from .record import Recorder

__all__ = ["reduce_scatter", "all_gather", "all_reduce", "pad_to_multiple", "release_scratch"]

#: a chunk (S/N bytes) travels as up to PIPELINE pieces of at least PIPELINE_MIN_BYTES
PIPELINE_MIN_BYTES, PIPELINE = 2 * 1024 * 1024, 4
_SCRATCH: dict = {}


def _scratch(numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
    """A reused 1-D buffer of ``numel`` elements of ``like``'s dtype and device."""
    key = (like.dtype, like.device, slot)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def release_scratch() -> None:
    """Free the scratch buffers the ring keeps between calls (two of S/N bytes per dtype)."""
    _SCRATCH.clear()


def _ring(group):
    ranks = comm.group_ranks(group)
    return ranks, len(ranks), dist.get_rank(group)


def pad_to_multiple(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """``(flat copy of t padded with zeros to a multiple of n elements, pad count)``."""
    flat = t.reshape(-1)
    pad = (-flat.numel()) % n
    return (torch.nn.functional.pad(flat, (0, pad)) if pad else flat.clone()), pad


def _pieces(numel: int, nbytes: int) -> list[tuple[int, int]]:
    """Piece boundaries of one chunk: as many pieces of at least ``PIPELINE_MIN_BYTES`` as
    fit, at most ``PIPELINE``. A piece costs each rank about 65 µs of CPU per step (its
    irecv, isend and waits through Python, labkit.comm and gloo's handshake); with ranks
    sharing cores, smaller pieces cost more than their overlap saves (measured at N=4 on 2
    cores: 4 × 1 MiB pieces of a 16 MiB all-reduce took ~8 % more CPU per rank and ~5 %
    more time than 2 × 2 MiB)."""
    p = max(1, min(PIPELINE, nbytes // PIPELINE_MIN_BYTES, numel))
    edges = [numel * i // p for i in range(p + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _wait(handles) -> None:
    for h in handles:
        h.wait()


def _rs_steps(chunks: list, reduce: str, group, rec: Optional[Recorder], step0: int) -> None:
    """Ring reduce-scatter in place over ``chunks`` (N equal 1-D views); rank r ends with
    the reduced chunk r. Records steps ``step0+1 … step0+N−1`` when ``rec`` is given.

    Pipelined: each step's chunk travels as pieces, the receives of step s+1 are posted
    (into the other of two scratch buffers) before step s is reduced, and each piece is sent
    on as soon as it is reduced, so the ring never idles waiting for a whole step."""
    ranks, n, me = _ring(group)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    k = chunks[0].numel()
    pieces = _pieces(k, k * chunks[0].element_size()) if rec is None else [(0, k)]
    tmp = (_scratch(k, chunks[0], 0), _scratch(k, chunks[0], 1))

    def post_recvs(s):
        return [comm.irecv(tmp[s % 2][a:b], left, group) for a, b in pieces]

    recvs = post_recvs(0) if n > 1 else []
    sends = [comm.isend(chunks[(me - 1) % n][a:b], right, group) for a, b in pieces] \
        if n > 1 else []
    for s in range(n - 1):
        last = s == n - 2
        nxt = [] if last else post_recvs(s + 1)
        rc = (me - s - 2) % n  # the chunk arriving now is the one to send next step
        new_sends = []
        for (a, b), h in zip(pieces, recvs):
            h.wait()
            combine_(chunks[rc][a:b], tmp[s % 2][a:b], reduce)
            if not last:
                new_sends.append(comm.isend(chunks[rc][a:b], right, group))
        _wait(sends)
        sends, recvs = new_sends, nxt
        if rec is not None:
            rec.recv(step0 + s + 1, (me - 1) % n, rc, k * tmp[0].element_size(), "reduce",
                     phase="reduce-scatter")
            rec.end_step(step0 + s + 1, chunks, "reduce-scatter")


def _ag_steps(chunks: list, group, rec: Optional[Recorder], step0: int) -> None:
    """Ring all-gather in place over ``chunks``; rank r starts with chunk r complete.
    Pipelined like :func:`_rs_steps`: a piece is forwarded as soon as it has arrived."""
    ranks, n, me = _ring(group)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    k = chunks[0].numel()
    pieces = _pieces(k, k * chunks[0].element_size()) if rec is None else [(0, k)]

    def post_recvs(s):
        return [comm.irecv(chunks[(me - s - 1) % n][a:b], left, group) for a, b in pieces]

    recvs = post_recvs(0) if n > 1 else []
    sends = [comm.isend(chunks[me][a:b], right, group) for a, b in pieces] if n > 1 else []
    for s in range(n - 1):
        last = s == n - 2
        nxt = [] if last or rec is not None else post_recvs(s + 1)
        rc = (me - s - 1) % n
        new_sends = []
        for (a, b), h in zip(pieces, recvs):
            h.wait()
            if not last:
                new_sends.append(comm.isend(chunks[rc][a:b], right, group))
        _wait(sends)
        if rec is not None:  # snapshot before the next step's data may land
            rec.recv(step0 + s + 1, (me - 1) % n, rc, comm.nbytes(chunks[rc]), "copy",
                     phase="all-gather")
            rec.end_step(step0 + s + 1, chunks, "all-gather")
            nxt = [] if last else post_recvs(s + 1)
        sends, recvs = new_sends, nxt


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, reduce: str = "sum", group=None,
                   recorder: Optional[Recorder] = None) -> torch.Tensor:
    """Ring reduce-scatter: ``output`` (k elements) on group rank r gets chunk r of the
    reduction of every rank's ``input`` (N·k elements, any shape, cut flat in N).

    Bytes sent and received per rank: (N−1)/N · |input|. ``input`` is not modified.

    Raises:
        ValueError: ``input`` does not split in N equal chunks (the message says how to
            pad), ``output`` has the wrong size, an unknown reduce op, or ``avg`` on ints.
    """
    n = comm.group_size(group)
    check_reduce(reduce, input.dtype)
    k = check_divisible(input.numel(), n, "ring reduce_scatter")
    if output.numel() != k:
        raise ValueError(f"ring reduce_scatter: output has {output.numel()} elements, "
                         f"expected |input|/N = {input.numel()}/{n} = {k}")
    me = dist.get_rank(group)
    work = input.reshape(-1).clone()
    chunks = [work[i * k:(i + 1) * k] for i in range(n)]
    if recorder is not None:
        recorder.inputs(chunks)
        recorder.end_step(0, chunks, "start")
    _rs_steps(chunks, reduce, group, recorder, 0)
    if reduce == "avg":
        chunks[me].div_(n)
    output.copy_(chunks[me].view(output.shape))
    return output


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
               recorder: Optional[Recorder] = None) -> torch.Tensor:
    """Ring all-gather: ``output`` (N·k elements) gets every rank's ``input`` (k elements)
    in rank order. Bytes sent and received per rank: (N−1)/N · |output|.

    Raises:
        ValueError: ``output`` is not N × ``input`` elements.
    """
    n, me, k = comm.group_size(group), dist.get_rank(group), input.numel()
    if output.numel() != n * k:
        raise ValueError(f"ring all_gather: output has {output.numel()} elements, expected "
                         f"N × input = {n} × {k}")
    work = output.view(-1) if output.is_contiguous() else torch.empty(
        n * k, dtype=output.dtype, device=output.device)
    chunks = [work[i * k:(i + 1) * k] for i in range(n)]
    chunks[me].copy_(input.reshape(-1))
    if recorder is not None:
        recorder.inputs([chunks[i] if i == me else None for i in range(n)])
        recorder.end_step(0, [chunks[i] if i == me else None for i in range(n)], "start")
    _ag_steps(chunks, group, _Filling(recorder, me, n) if recorder else None, 0)
    if work.data_ptr() != output.data_ptr():
        output.copy_(work.view(output.shape))
    return output


class _Filling:
    """Recorder proxy for all-gather: chunks not yet received snapshot as ``None``."""

    def __init__(self, rec: Recorder, me: int, n: int):
        self.rec, self.have = rec, {me}

    def recv(self, step, src, chunk, *a, **kw):
        self.have.add(chunk)
        self.rec.recv(step, src, chunk, *a, **kw)

    def end_step(self, step, chunks, phase=""):
        self.rec.end_step(step, [c if i in self.have else None for i, c in enumerate(chunks)],
                          phase)


def all_reduce(tensor: torch.Tensor, reduce: str = "sum", group=None,
               recorder: Optional[Recorder] = None) -> torch.Tensor:
    """Ring all-reduce in place: reduce-scatter, then all-gather (2(N−1) steps).

    ``tensor`` may have any shape and size. When N does not divide its element count the
    ring runs on a zero-padded copy of ⌈numel/N⌉·N elements (padding only ever meets
    padding) and the bytes counted are those of the padded message. Bytes per rank, each
    way: 2(N−1)/N · S, S = the (padded) message.

    Raises:
        ValueError: an unknown reduce op, or ``avg`` of an integer tensor.
    """
    n = comm.group_size(group)
    check_reduce(reduce, tensor.dtype)
    if n == 1:
        if recorder is not None:
            recorder.inputs([tensor])
            recorder.end_step(0, [tensor], "start")
        return tensor
    pad = (-tensor.numel()) % n
    inplace = pad == 0 and tensor.is_contiguous()
    work = tensor.view(-1) if inplace else pad_to_multiple(tensor, n)[0]
    k = work.numel() // n
    chunks = [work[i * k:(i + 1) * k] for i in range(n)]
    if recorder is not None:
        recorder.inputs(chunks)
        recorder.end_step(0, chunks, "start")
    _rs_steps(chunks, reduce, group, recorder, 0)
    _ag_steps(chunks, group, recorder, n - 1)
    if reduce == "avg":
        work.div_(n)
    if not inplace:
        tensor.copy_(work[:tensor.numel()].view(tensor.shape))
    return tensor
