"""labkit's flight recorder: every collective each rank entered and left, readable while
the rank is stuck.

Each rank of a :class:`labkit.Cluster` maps a small file in the pool's private folder and,
for every collective issued through :mod:`labkit.comm`, writes one fixed-size record —
the op, the group (a bit mask of global ranks), the per-group sequence number (the n-th
collective this rank issued on that group in this job), the step, the element count, the
enter time and, once ``wait()`` returns, the exit time — into a ring of
:data:`CAPACITY` records. Writing is a ``struct.pack_into`` on shared memory (about a
microsecond), and the parent reads the files without the ranks' help, so a rank blocked
forever inside gloo still tells where it is.

This is the idea of PyTorch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``; its analyzer
``torch.distributed.flight_recorder``, the "fr_trace" script), which NCCL and, since torch
2.6, gloo fill; but its ring is read by calling into the stuck process, and recording it
costs ~12 µs per gloo collective on this machine (``benchmarks/fault_recovery.py`` notes
it), so labkit keeps its own and also dumps torch's when the environment enables it.

:func:`diagnose` turns the records of all ranks into a :class:`HangReport`: the collective
that some ranks entered and others did not, its group and sequence number, who entered,
who is missing and where each missing rank is.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["CAPACITY", "OPS", "FlightRecorder", "RankRecords", "Record", "HangReport",
           "open_recorder", "active", "read_records", "diagnose", "divergences",
           "request_dump"]

#: records kept per rank (a ring): a tiny GPT's step issues a handful of collectives
CAPACITY = 1024
OPS = ("?", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
       "reduce", "barrier")
_OP_CODE = {name: i for i, name in enumerate(OPS)}
#: header: job, step, records written, fault time, fault kind code, dump request, pid
_HDR = struct.Struct("<qqqdqqq")
#: one record: seq, group mask, op code, step, numel, enter time, exit time (0: in flight)
_REC = struct.Struct("<qQqqqdd")
_SIZE = _HDR.size + CAPACITY * _REC.size
_EXIT_AT = struct.calcsize("<qQqqqd")  # offset of the exit time within a record
FAULT_CODES = ("", "kill", "hang", "skip", "slow", "bitflip")


@dataclass
class Record:
    """One collective as one rank saw it. Times are ``time.perf_counter()`` seconds
    (CLOCK_MONOTONIC, shared by the processes of one machine); ``t_exit`` is ``None``
    while the rank is still inside it."""

    seq: int
    group: tuple
    op: str
    step: int
    numel: int
    t_enter: float
    t_exit: Optional[float]

    @property
    def signature(self) -> tuple:
        """What every member must agree on for this collective to match."""
        return (self.op, self.numel, self.step)


class FlightRecorder:
    """The rank side: one mapped file, written on every collective."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _SIZE)
            self._mm = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self.path = path
        self.begin_job(-1)

    def begin_job(self, job: int) -> None:
        """Forget the previous job: sequence numbers restart at 0 in every group."""
        self._seq: dict = {}
        self._n = 0
        self._step = -1
        self._mm[:_SIZE] = bytes(_SIZE)
        _HDR.pack_into(self._mm, 0, job, -1, 0, 0.0, 0, 0, os.getpid())

    def set_step(self, step: int) -> None:
        self._step = step
        struct.pack_into("<q", self._mm, 8, step)

    def note_fault(self, kind: str, t: float) -> None:
        """Stamp the moment a fault was injected (the cluster measures detection from it)."""
        struct.pack_into("<dq", self._mm, 24, t, FAULT_CODES.index(kind))

    def enter(self, op: str, ranks: tuple, numel: int, t: float) -> int:
        mask = 0
        for r in ranks:
            mask |= 1 << r
        seq = self._seq.get(mask, 0)
        self._seq[mask] = seq + 1
        slot = self._n % CAPACITY
        _REC.pack_into(self._mm, _HDR.size + slot * _REC.size, seq, mask,
                       _OP_CODE.get(op, 0), self._step, numel, t, 0.0)
        self._n += 1
        struct.pack_into("<q", self._mm, 16, self._n)
        return slot

    def exit(self, slot: int, t: float) -> None:
        struct.pack_into("<d", self._mm, _HDR.size + slot * _REC.size + _EXIT_AT, t)

    def dump_requested(self) -> bool:
        return struct.unpack_from("<q", self._mm, 40)[0] == 1

    def dump_done(self) -> None:
        struct.pack_into("<q", self._mm, 40, 2)


_ACTIVE: Optional[FlightRecorder] = None


def open_recorder(path: Optional[str]) -> Optional[FlightRecorder]:
    """Make this process record into ``path`` (``None``: stop recording)."""
    global _ACTIVE
    _ACTIVE = FlightRecorder(path) if path else None
    return _ACTIVE


def active() -> Optional[FlightRecorder]:
    return _ACTIVE


# -- the parent's side ---------------------------------------------------------------------
@dataclass
class RankRecords:
    """What one rank's file says: its job, current step, an injected fault (kind and
    time) and its last :data:`CAPACITY` collectives, oldest first."""

    rank: int
    job: int
    step: int
    fault: str
    fault_t: Optional[float]
    records: list = field(default_factory=list)
    pid: int = 0
    dump_state: int = 0

    def in_flight(self) -> list:
        return [r for r in self.records if r.t_exit is None]


def _ranks(mask: int) -> tuple:
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def read_records(path: str, rank: int) -> Optional[RankRecords]:
    """Parse one rank's file; ``None`` if it does not exist (yet)."""
    try:
        with open(path, "rb") as f:
            buf = f.read(_SIZE)
    except OSError:
        return None
    if len(buf) < _SIZE:
        return None
    job, step, n, ft, fk, dump, pid = _HDR.unpack_from(buf, 0)
    recs = []
    for i in range(max(0, n - CAPACITY), n):
        seq, mask, op, st, numel, t0, t1 = _REC.unpack_from(buf, _HDR.size + (i % CAPACITY) * _REC.size)
        recs.append(Record(seq, _ranks(mask), OPS[op] if 0 <= op < len(OPS) else "?", st, numel,
                           t0, t1 if t1 else None))
    return RankRecords(rank, job, step, FAULT_CODES[fk] if 0 <= fk < len(FAULT_CODES) else "?",
                       ft or None, recs, pid, dump)


def request_dump(path: str) -> None:
    """Ask the rank's dump thread to write torch's Flight Recorder (when enabled)."""
    try:
        with open(path, "r+b") as f:
            f.seek(40)
            f.write(struct.pack("<q", 1))
    except OSError:
        pass


@dataclass
class HangReport:
    """Which rank hung where.

    Attributes:
        op: the collective the waiting ranks are inside (``"all_reduce"`` …).
        group: global ranks of its process group.
        seq: its sequence number in that group (0-based: the seq-th collective issued on
            the group in this job).
        step: the training step the waiting ranks are in.
        entered: ranks of the group inside it (waiting for the others).
        missing: ranks of the group that never entered it.
        waited_s: how long the earliest entrant has been waiting (seconds).
        where: ``{missing rank: where it is}`` in words.
        divergence: when a missing rank issued the group's collectives out of step with the
            others (a skipped or extra collective), the first sequence number at which they
            disagree and how; else ``None``.
    """

    op: str
    group: tuple
    seq: int
    step: int
    entered: tuple
    missing: tuple
    waited_s: float
    where: dict
    divergence: Optional[str] = None

    def __str__(self) -> str:
        lines = [f"{self.op} #{self.seq} on group {list(self.group)} (step {self.step}): "
                 f"ranks {list(self.entered)} entered it and waited {self.waited_s:.1f} s; "
                 f"rank{'s' if len(self.missing) != 1 else ''} {list(self.missing)} never did"]
        lines += [f"  rank {r}: {w}" for r, w in sorted(self.where.items())]
        if self.divergence:
            lines.append(f"  {self.divergence}")
        return "\n".join(lines)


def _where(rr: Optional[RankRecords], group: tuple, alive: bool) -> str:
    if rr is None:
        return "no flight record (the rank never started this job)"
    own = [r for r in rr.records if r.group == group]
    last = (f"its last collective on this group was {own[-1].op} #{own[-1].seq} "
            f"(step {own[-1].step})" if own else "it issued no collective on this group")
    if not alive:
        return f"process dead in step {rr.step}; {last}"
    fly = rr.in_flight()
    if fly:
        f = fly[-1]
        return f"inside {f.op} #{f.seq} on group {list(f.group)} (step {f.step}); {last}"
    return f"in step {rr.step}, outside any collective (computing, stalled, or done); {last}"


def diagnose(by_rank: dict, now: float, alive: Optional[dict] = None) -> Optional[HangReport]:
    """The collective a hang is stuck in, from every rank's :class:`RankRecords`.

    The stuck collective is the oldest one still in flight on some rank whose group has a
    member that has not entered it (a member that entered it too, say a stalled network,
    appears under ``entered``). Returns ``None`` when no rank is inside a collective.

    Args:
        by_rank: ``{rank: RankRecords or None}`` for the job's ranks.
        now: the current ``time.perf_counter()``.
        alive: ``{rank: bool}``, whether each process is still running.
    """
    alive = alive or {}
    stuck = [(rec, r) for r, rr in by_rank.items() if rr is not None for rec in rr.in_flight()]
    if not stuck:
        return None
    candidates = []
    for rec, r in stuck:
        members = rec.group
        entered = tuple(m for m in members if by_rank.get(m) is not None
                        and any(x.group == members and x.seq == rec.seq for x in by_rank[m].records))
        missing = tuple(m for m in members if m not in entered)
        candidates.append((bool(missing), -rec.t_enter, rec, entered, missing))
    # a group with a missing member first; among those the longest wait
    _, _, rec, entered, missing = max(candidates, key=lambda c: (c[0], c[1]))
    waited = max(now - x.t_enter for x, r in stuck if x.group == rec.group and x.seq == rec.seq)
    where = {m: _where(by_rank.get(m), rec.group, alive.get(m, True)) for m in missing}
    return HangReport(rec.op, rec.group, rec.seq, rec.step, entered, missing, waited, where,
                      _divergence(by_rank, rec.group))


def _divergence(by_rank: dict, group: tuple) -> Optional[str]:
    """The first sequence number of ``group`` at which its members' collectives differ
    (op, element count or step): where a rank skipped one or issued an extra one."""
    seqs = {m: {x.seq: x for x in by_rank[m].records if x.group == group}
            for m in group if by_rank.get(m) is not None}
    if len(seqs) < 2:
        return None
    common = set.intersection(*(set(s) for s in seqs.values()))
    for k in sorted(common):
        sigs = {m: s[k].signature for m, s in seqs.items()}
        if len(set(sigs.values())) > 1:
            counts: dict = {}
            for m, sig in sigs.items():
                counts.setdefault(sig, []).append(m)
            usual = max(counts.items(), key=lambda kv: len(kv[1]))[0]
            odd = sorted(m for m, sig in sigs.items() if sig != usual)
            first = seqs[odd[0]][k]
            return (f"sequences diverge at #{k}: ranks {odd} issued {first.op} of "
                    f"{first.numel} elements in step {first.step} where the others issued "
                    f"{usual[0]} of {usual[1]} elements in step {usual[2]}: rank"
                    f"{'s' if len(odd) > 1 else ''} {odd} skipped (or added) a collective "
                    f"before it")
    return None


def divergences(by_rank: dict) -> list:
    """``[text]``: for every group whose members' collective sequences disagree, where
    (see :func:`diagnose`'s ``divergence``). A skipped collective that paired with a
    peer's other collective of another size makes gloo abort the process ("Received data
    size doesn't match expected size"), so a death is checked for this too."""
    groups = {rec.group for rr in by_rank.values() if rr is not None for rec in rr.records}
    out = []
    for g in sorted(groups):
        d = _divergence(by_rank, g)
        if d:
            out.append(f"group {list(g)}: {d}")
    return out
