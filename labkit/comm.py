"""The one place labkit communicates: traced collectives and point-to-point calls.

Every function here calls ``torch.distributed`` and records an :class:`labkit.trace.Event`
into the running job's tracer with the op, the mesh axis, the peers and the bytes this rank
moved. Everything else in labkit (data parallelism, ZeRO, hand-built ring and tree
algorithms) communicates only through this module, so traces and byte counts are complete.

Byte accounting. The counts are *algorithmic*: the bytes each rank sends (and receives)
when the collective runs as the bandwidth-optimal ring of the lectures and of nccl-tests
(Patarasuk & Yuan 2009; nccl-tests ``PERFORMANCE.md``). For a tensor of ``S`` bytes over
``N`` ranks:

=================  ===========================================
all-reduce         2(N−1)/N · S  sent, the same received
reduce-scatter     (N−1)/N · S   (S = the full, unscattered input)
all-gather         (N−1)/N · S   (S = the full, gathered output)
all-to-all         (N−1)/N · S   (S = this rank's input)
all-to-all-v       the rows this rank sends to (receives from) other ranks, exactly
broadcast          S per hop: the root sends S, every other rank receives S
reduce             S per hop: every non-root sends S, the root receives S
send / recv        S
=================  ===========================================

gloo implements some collectives internally with other algorithms (for example
all-reduce of large tensors without a ring, pytorch/pytorch#149869), so its wire bytes and
timing are not always the ring's. Counting the algorithm's bytes keeps the numbers
comparable to the lectures' formulas on every backend.

So for the native collectives the bytes are the formula, not a measurement, and every such
event says so: ``args["bytes"] == "formula"``. Point-to-point events (``send``/``recv``, and
so labkit's hand-built algorithms in :mod:`labkit.collectives`, which are made of them)
carry the payload each call really handed to the backend: ``args["bytes"] == "measured"``
(payload only: headers and the transport's own traffic are not in it).
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import comm_release
from .comm_handle import Handle
from .comm_release import refs
from .faults import inject as _inject
from .faults import recorder as _recorder
from .trace import COMM, P2P, Event, current_tracer

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_list",
           "all_to_all_single",
           "broadcast", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv",
           "barrier", "Handle", "group_size", "group_ranks", "nbytes", "BYTES_FORMULA",
           "BYTES_MEASURED"]

#: ``Event.args["bytes"]``: how the event's byte counts were obtained
BYTES_FORMULA, BYTES_MEASURED = "formula", "measured"

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}


# torch 2.13 renamed the tensor forms (the old names warn); older releases only have those
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def group_size(group=None) -> int:
    return dist.get_world_size(group)


def group_ranks(group=None) -> tuple:
    """Global ranks of ``group`` in group-rank order."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _reduce_op(op: str):
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_OPS)}") from None


# A compiled block (``torch.compile``) calls collectives from inside its graph: run them
# eagerly, one graph break each, rather than have dynamo trace the tracing and the waits
@torch.compiler.disable
def _run(op_name, cat, call, *, group, axis, sent, recv, peers, async_op, finish=None,
         tensors: Sequence[torch.Tensor] = (), **args):
    """Issue ``call(async_op=True)`` (always asynchronous, so the handle owns the work and
    can wait for its ``tensors`` to be released), trace it, and wait unless ``async_op``."""
    tracer = current_tracer()
    event = None
    if tracer is not None:
        args["bytes"] = BYTES_FORMULA if cat == COMM else BYTES_MEASURED
        event = Event(tracer.rank, op_name, cat, tracer.now(), 0.0, op=op_name,
                      bytes_sent=float(sent), bytes_recv=float(recv), axis=axis,
                      peers=tuple(peers), args=args)
    if _inject._armed and _inject.on_collective(op_name):
        return Handle(None, None) if async_op else None  # an injected fault: skipped
    rec, slot = _recorder._ACTIVE, None
    if rec is not None and cat == COMM:  # readable by the parent while this rank is stuck
        slot = rec.enter(op_name, tuple(peers), int(args.get("numel", 0)), time.perf_counter())
        if _inject._armed:
            _inject.after_enter(op_name)  # an injected stall freezes the rank here
    before = refs(tensors) if comm_release.active() else None
    handle = Handle(call(True), event, finish, tensors, before,  # the only reference to the work
                    recorded=slot)
    if async_op:
        handle.note_done()
        return handle
    handle.wait()
    return None


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, axis: Optional[str] = None,
               async_op: bool = False, **tags) -> Optional[Handle]:
    """In-place all-reduce of ``tensor`` (any shape) over ``group``.

    ``tags`` (e.g. ``bucket=3``) are stored in the trace event's ``args``.

    ``op="avg"`` is computed as a sum followed by a division by N, because gloo has no
    native average. Bytes: 2(N−1)/N · S each way.
    """
    n, s = group_size(group), nbytes(tensor)
    rop = _reduce_op(op)
    finish = (lambda: tensor.div_(n)) if op == "avg" else None
    return _run("all_reduce", COMM, lambda a: dist.all_reduce(tensor, rop, group, a),
                group=group, axis=axis, sent=2 * (n - 1) * s / n, recv=2 * (n - 1) * s / n,
                peers=group_ranks(group), async_op=async_op, finish=finish, tensors=(tensor,),
                numel=tensor.numel(), reduce=op, **tags)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None,
                   axis: Optional[str] = None, async_op: bool = False, **tags) -> Optional[Handle]:
    """Reduce ``input`` (N·k elements, dim 0 split in N equal chunks) and leave chunk ``r``
    on group rank ``r`` in ``output`` (k elements). Bytes: (N−1)/N · |input|.

    Raises:
        ValueError: if ``input`` does not split evenly; pad it to a multiple of N first.
    """
    n, s = group_size(group), nbytes(input)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, which is not "
                         f"N={n} x output ({output.numel()}); pad the input to a multiple of "
                         f"{n} elements")
    rop = _reduce_op(op)
    finish = (lambda: output.div_(n)) if op == "avg" else None
    return _run("reduce_scatter", COMM,
                lambda a: _reduce_scatter_tensor(output, input, rop, group, a),
                group=group, axis=axis, sent=(n - 1) * s / n, recv=(n - 1) * s / n,
                peers=group_ranks(group), async_op=async_op, finish=finish,
                tensors=(output, input), numel=input.numel(), reduce=op, **tags)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
               axis: Optional[str] = None, async_op: bool = False, **tags) -> Optional[Handle]:
    """Concatenate every rank's ``input`` (k elements) into ``output`` (N·k), rank order.
    Bytes: (N−1)/N · |output|."""
    n, s = group_size(group), nbytes(output)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"N={n} x input ({input.numel()})")
    return _run("all_gather", COMM,
                lambda a: _all_gather_tensor(output, input, group, a),
                group=group, axis=axis, sent=(n - 1) * s / n, recv=(n - 1) * s / n,
                peers=group_ranks(group), async_op=async_op, tensors=(output, input),
                numel=output.numel(), **tags)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
               axis: Optional[str] = None, async_op: bool = False, **tags) -> Optional[Handle]:
    """Chunk ``j`` of ``input`` (dim 0 split in N) goes to group rank ``j``; chunk ``i`` of
    ``output`` comes from group rank ``i`` — a distributed transpose. Bytes: (N−1)/N · S.
    ``tags`` are stored in the trace event's ``args``."""
    n, s = group_size(group), nbytes(input)
    if input.shape[0] % n:
        raise ValueError(f"all_to_all: dim 0 of input ({input.shape[0]}) does not divide by "
                         f"N={n}; pad it to a multiple of {n}")
    return _run("all_to_all", COMM,
                lambda a: dist.all_to_all_single(output, input, group=group, async_op=a),
                group=group, axis=axis, sent=(n - 1) * s / n, recv=(n - 1) * s / n,
                peers=group_ranks(group), async_op=async_op, tensors=(output, input),
                numel=input.numel(), **tags)


def all_to_all_list(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    group=None, axis: Optional[str] = None) -> None:
    """List form: ``inputs[j]`` goes to group rank ``j``, ``outputs[i]`` comes from rank ``i``.
    Bytes: everything but this rank's own piece, each way."""
    me = dist.get_rank(group)
    sent = sum(nbytes(t) for j, t in enumerate(inputs) if j != me)
    recv = sum(nbytes(t) for i, t in enumerate(outputs) if i != me)
    _run("all_to_all", COMM, lambda a: dist.all_to_all(list(outputs), list(inputs), group, a),
         group=group, axis=axis, sent=sent, recv=recv, peers=group_ranks(group),
         async_op=False, tensors=(*outputs, *inputs), form="list")


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None, group=None,
                      axis: Optional[str] = None, async_op: bool = False,
                      **tags) -> Optional[Handle]:
    """All-to-all with variable split sizes (MPI's all-to-all-v): rows
    ``input[sum(in[:j]) : sum(in[:j+1])]`` go to group rank ``j``; the rows from group rank
    ``i`` land in ``output[sum(out[:i]) : sum(out[:i+1])]``. Sizes count rows of dim 0 and may
    be 0 (a rank may send nothing at all); ``None`` means equal splits. Every rank's
    ``input_split_sizes[j]`` must equal rank ``j``'s ``output_split_sizes[me]``.

    Bytes, exactly: this rank's rows to other ranks (its own split is a local copy), and
    the rows it receives from them. The event's ``args`` hold ``bytes_to`` and
    ``bytes_from`` per group rank (own rank 0) and any ``tags``.

    Raises:
        ValueError: a split list not of length N, a negative size, sizes not summing to
            dim 0, or equal splits that do not divide dim 0.
    """
    n, me = group_size(group), dist.get_rank(group)
    splits = []
    for name, t, sizes in (("input", input, input_split_sizes),
                           ("output", output, output_split_sizes)):
        rows = t.shape[0] if t.dim() else 0
        if sizes is None:
            if rows % n:
                raise ValueError(f"all_to_all_single: dim 0 of {name} ({rows}) does not divide "
                                 f"by N={n}; pass {name}_split_sizes")
            sizes = [rows // n] * n
        sizes = [int(v) for v in sizes]
        if len(sizes) != n or min(sizes) < 0 or sum(sizes) != rows:
            raise ValueError(f"all_to_all_single: {name}_split_sizes={sizes} must be {n} sizes "
                             f">= 0 summing to dim 0 of {name} ({rows})")
        row_bytes = math.prod(t.shape[1:]) * t.element_size()
        splits.append((sizes, [0 if j == me else v * row_bytes for j, v in enumerate(sizes)]))
    (in_sizes, to), (out_sizes, frm) = splits
    return _run("all_to_all", COMM,
                lambda a: dist.all_to_all_single(output, input, out_sizes, in_sizes, group=group,
                                                 async_op=a),
                group=group, axis=axis, sent=sum(to), recv=sum(frm), peers=group_ranks(group),
                async_op=async_op, tensors=(output, input), form="v", bytes_to=to,
                bytes_from=frm, **tags)


def broadcast(tensor: torch.Tensor, src: int, group=None, axis: Optional[str] = None) -> None:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``. Bytes: S per hop."""
    s, me = nbytes(tensor), dist.get_rank()
    _run("broadcast", COMM, lambda a: dist.broadcast(tensor, src, group, a), group=group,
         axis=axis, sent=s if me == src else 0, recv=0 if me == src else s,
         peers=group_ranks(group), async_op=False, tensors=(tensor,), root=src)


def reduce(tensor: torch.Tensor, dst: int, op: str = "sum", group=None,
           axis: Optional[str] = None) -> None:
    """Reduce into ``tensor`` on global rank ``dst`` only; other ranks' buffers are left
    unspecified afterwards (do not read them). Bytes: S per hop."""
    s, me, n = nbytes(tensor), dist.get_rank(), group_size(group)
    finish = (lambda: tensor.div_(n)) if op == "avg" and me == dst else None
    _run("reduce", COMM, lambda a: dist.reduce(tensor, dst, _reduce_op(op), group, a),
         group=group, axis=axis, sent=0 if me == dst else s, recv=s if me == dst else 0,
         peers=group_ranks(group), async_op=False, finish=finish, tensors=(tensor,), root=dst,
         reduce=op)


def send(tensor: torch.Tensor, dst: int, group=None, axis: Optional[str] = None,
         tag: int = 0) -> None:
    """Blocking send of ``tensor`` to global rank ``dst``."""
    _run("send", P2P, lambda a: dist.isend(tensor, dst, group, tag), group=group, axis=axis,
         sent=nbytes(tensor), recv=0, peers=(dst,), async_op=False, tensors=(tensor,))


def recv(tensor: torch.Tensor, src: int, group=None, axis: Optional[str] = None,
         tag: int = 0) -> None:
    """Blocking receive into ``tensor`` from global rank ``src``."""
    _run("recv", P2P, lambda a: dist.irecv(tensor, src, group, tag), group=group, axis=axis,
         sent=0, recv=nbytes(tensor), peers=(src,), async_op=False, tensors=(tensor,))


def isend(tensor: torch.Tensor, dst: int, group=None, axis: Optional[str] = None,
          tag: int = 0) -> Handle:
    """Non-blocking send; call ``wait()`` on the handle."""
    return _run("send", P2P, lambda a: dist.isend(tensor, dst, group, tag), group=group,
                axis=axis, sent=nbytes(tensor), recv=0, peers=(dst,), async_op=True,
                tensors=(tensor,))


def irecv(tensor: torch.Tensor, src: int, group=None, axis: Optional[str] = None,
          tag: int = 0) -> Handle:
    """Non-blocking receive; call ``wait()`` on the handle."""
    return _run("recv", P2P, lambda a: dist.irecv(tensor, src, group, tag), group=group,
                axis=axis, sent=0, recv=nbytes(tensor), peers=(src,), async_op=True,
                tensors=(tensor,))


def batch_isend_irecv(sends: Sequence[tuple], recvs: Sequence[tuple], group=None,
                      axis: Optional[str] = None, tag: int = 0, **tags) -> list[Handle]:
    """Post ``sends`` [(tensor, dst)] and ``recvs`` [(tensor, src)] together, so a ring step
    where every rank sends and receives cannot deadlock. Returns one handle per op.
    ``tag`` matches sends to receives (gloo); ``tags`` go into the trace events' ``args``."""
    ops = ([dist.P2POp(dist.isend, t, peer, group, tag) for t, peer in sends]
           + [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer in recvs])
    pairs = list(sends) + list(recvs)
    before = refs([t for t, _ in pairs]) if comm_release.active() else [None] * len(pairs)
    works = dist.batch_isend_irecv(ops) if ops else []
    tracer = current_tracer()
    handles = []
    for (kind, t, peer), work in zip([("send", t, p) for t, p in sends]
                                     + [("recv", t, p) for t, p in recvs], works):
        ev = None
        if tracer is not None:
            ev = Event(tracer.rank, kind, P2P, tracer.now(), 0.0, op=kind,
                       bytes_sent=float(nbytes(t)) if kind == "send" else 0.0,
                       bytes_recv=float(nbytes(t)) if kind == "recv" else 0.0,
                       axis=axis, peers=(peer,), args={**tags, "bytes": BYTES_MEASURED})
        n = before[len(handles)]
        handles.append(Handle(work, ev, tensors=(t,), before=None if n is None else [n]))
    return handles


def barrier(group=None) -> None:
    """Block until every rank of ``group`` arrives (not traced: it moves no payload)."""
    dist.barrier(group)
