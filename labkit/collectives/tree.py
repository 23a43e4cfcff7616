"""Binomial-tree broadcast and reduce, and the recursive-doubling all-reduce.

These are the latency-optimal algorithms of Thakur, Rabenseifner & Gropp ("Optimization of
collective communication operations in MPICH", IJHPCA 19(1), 2005): ⌈log2 N⌉ rounds
instead of the ring's N−1 or 2(N−1), at the price of moving the *whole* message in every
round. For small messages latency (rounds) dominates and they win; for large ones the
ring's (N−1)/N·S per phase wins.

Ranks are numbered relative to the root, ``v = (rank − root) mod N``.

* **Broadcast** (§3.1): in round k (mask 2^k) every rank v < 2^k that already has the data
  sends it to v + 2^k. Each rank receives S once; the root sends to ⌈log2 N⌉ children.
* **Reduce**: the same tree run backwards. In round j (mask 2^k, k = ⌈log2 N⌉−1−j) rank v
  with 2^k ≤ v < 2^(k+1) sends its partial result to v − 2^k and is done; v < 2^k combines
  what arrives from v + 2^k. Only the root's buffer holds the result: every other rank's
  buffer holds a partial sum afterwards and must not be read (as with ``dist.reduce``).
* **All-reduce by recursive doubling** (§4.1): in round k, rank r exchanges its whole
  buffer with r XOR 2^k and both combine, so after log2 N rounds everyone has the result.
  A non-power-of-two N = p + r (p = 2^⌊log2 N⌋) first folds: the even ranks below 2r send
  their buffer to the next odd rank, the p survivors double, and the odd ranks send the
  result back. Bytes per rank: log2(N)·S each way for a power of two
  (:func:`labkit.collectives.formula_bytes` gives the general count).

Bytes "per hop" are S: every message here is the whole buffer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from . import check_reduce, combine_
from .record import Recorder

__all__ = ["broadcast", "reduce", "all_reduce_recursive_doubling", "rounds"]


def rounds(n: int) -> int:
    """⌈log2 n⌉: rounds of a binomial tree over ``n`` ranks."""
    return max(n - 1, 0).bit_length()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def _done(t: torch.Tensor, work: torch.Tensor) -> None:
    if work.data_ptr() != t.data_ptr():
        t.copy_(work.view(t.shape))


def broadcast(tensor: torch.Tensor, src: int, group=None,
              recorder: Optional[Recorder] = None) -> torch.Tensor:
    """Binomial-tree broadcast of ``tensor`` (any shape) from global rank ``src``.

    Bytes: S per hop; each non-root rank receives S, each rank sends S per child.

    Raises:
        ValueError: ``src`` is not in ``group``.
    """
    ranks = comm.group_ranks(group)
    n, me = len(ranks), dist.get_rank(group)
    if src not in ranks:
        raise ValueError(f"tree broadcast: src={src} is not a rank of the group {ranks}")
    root = ranks.index(src)
    v = (me - root) % n
    work = _flat(tensor)
    have = v == 0
    if recorder is not None:
        recorder.inputs([work])
        recorder.end_step(0, [work if have else None], "start")
    for k in range(rounds(n)):
        mask = 1 << k
        if v < mask and v + mask < n:
            comm.send(work, ranks[(v + mask + root) % n], group=group)
        elif mask <= v < 2 * mask:
            parent = (v - mask + root) % n
            comm.recv(work, ranks[parent], group=group)
            have = True
            if recorder is not None:
                recorder.recv(k + 1, parent, 0, comm.nbytes(work), "copy", phase="broadcast")
        if recorder is not None:
            recorder.end_step(k + 1, [work if have else None], "broadcast")
    _done(tensor, work)
    return tensor


def reduce(tensor: torch.Tensor, dst: int, reduce: str = "sum", group=None,
           recorder: Optional[Recorder] = None) -> Optional[torch.Tensor]:
    """Binomial-tree reduce of every rank's ``tensor`` into ``tensor`` on global rank ``dst``.

    Returns ``tensor`` on ``dst`` and ``None`` elsewhere: other ranks' buffers are left
    holding partial results and are not meaningful afterwards. Bytes: S per hop; each
    non-root rank sends S once, each rank receives S per child.

    Raises:
        ValueError: ``dst`` not in ``group``, an unknown reduce op, or ``avg`` on ints.
    """
    ranks = comm.group_ranks(group)
    n, me = len(ranks), dist.get_rank(group)
    if dst not in ranks:
        raise ValueError(f"tree reduce: dst={dst} is not a rank of the group {ranks}")
    check_reduce(reduce, tensor.dtype)
    root = ranks.index(dst)
    v = (me - root) % n
    work = _flat(tensor)
    tmp = torch.empty_like(work)
    live = True
    if recorder is not None:
        recorder.inputs([work])
        recorder.end_step(0, [work], "start")
    total = rounds(n)
    for j in range(total):
        mask = 1 << (total - 1 - j)
        if live and mask <= v < 2 * mask:
            comm.send(work, ranks[(v - mask + root) % n], group=group)
            live = False  # passed its partial result up; the buffer means nothing now
        elif v < mask and v + mask < n:
            child = (v + mask + root) % n
            comm.recv(tmp, ranks[child], group=group)
            combine_(work, tmp, reduce)
            if recorder is not None:
                recorder.recv(j + 1, child, 0, comm.nbytes(tmp), "reduce", phase="reduce")
        if recorder is not None:
            recorder.end_step(j + 1, [work if live else None], "reduce")
    if v != 0:
        return None
    if reduce == "avg":
        work.div_(n)
    _done(tensor, work)
    return tensor


def all_reduce_recursive_doubling(tensor: torch.Tensor, reduce: str = "sum", group=None,
                                  recorder: Optional[Recorder] = None) -> torch.Tensor:
    """All-reduce ``tensor`` (any shape and size) in place by recursive doubling.

    Rounds: log2 N, plus two when N is not a power of two. Every rank ends with bitwise
    identical values (both partners of a round compute the same a ⊕ b).

    Raises:
        ValueError: an unknown reduce op, or ``avg`` of an integer tensor.
    """
    ranks = comm.group_ranks(group)
    n, me = len(ranks), dist.get_rank(group)
    check_reduce(reduce, tensor.dtype)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    work = _flat(tensor)
    tmp = torch.empty_like(work)
    step, live = 0, True

    def real(nr: int) -> int:  # survivor number -> group rank
        return 2 * nr + 1 if nr < rem else nr + rem

    def end(phase: str) -> None:
        if recorder is not None:
            recorder.end_step(step, [work if live else None], phase)

    if recorder is not None:
        recorder.inputs([work])
    end("start")
    newrank = me // 2 if me < 2 * rem else me - rem
    if rem:  # fold: even ranks below 2·rem hand their data to the next odd rank
        step += 1
        if me < 2 * rem and me % 2 == 0:
            comm.send(work, ranks[me + 1], group=group)
            live, newrank = False, -1
        elif me < 2 * rem:
            comm.recv(tmp, ranks[me - 1], group=group)
            combine_(work, tmp, reduce)
            if recorder is not None:
                recorder.recv(step, me - 1, 0, comm.nbytes(tmp), "reduce", phase="fold")
        end("fold")
    for k in range(p.bit_length() - 1):
        step += 1
        if newrank >= 0:
            partner = real(newrank ^ (1 << k))
            for h in comm.batch_isend_irecv([(work, ranks[partner])], [(tmp, ranks[partner])],
                                            group=group):
                h.wait()
            combine_(work, tmp, reduce)
            if recorder is not None:
                recorder.recv(step, partner, 0, comm.nbytes(tmp), "reduce", phase="doubling")
        end("doubling")
    if rem:  # unfold: odd ranks below 2·rem send the result back to their even partner
        step += 1
        if me < 2 * rem and me % 2 == 1:
            comm.send(work, ranks[me - 1], group=group)
        elif me < 2 * rem:
            comm.recv(work, ranks[me + 1], group=group)
            live = True
            if recorder is not None:
                recorder.recv(step, me + 1, 0, comm.nbytes(work), "copy", phase="unfold")
        end("unfold")
    if reduce == "avg":
        work.div_(n)
    _done(tensor, work)
    return tensor
