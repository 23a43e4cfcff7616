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

:func:`~.diagnose.diagnose` turns the records of all ranks into a :class:`HangReport`: the
collective that some ranks entered and others did not, its group and sequence number, who
entered, who is missing and where each missing rank is — or, when every member entered and
none left (a stall inside the backend), when each entered, its last completed collective and
its heartbeat (a thread writes ``time.perf_counter()`` every :data:`HEARTBEAT_S`).
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .diagnose import HangReport, diagnose, divergences  # noqa: F401 - the parent's side

__all__ = ["CAPACITY", "OPS", "HEARTBEAT_S", "FlightRecorder", "RankRecords", "Record",
           "HangReport", "open_recorder", "active", "read_records", "diagnose", "divergences",
           "request_dump"]

#: records kept per rank (a ring): a tiny GPT's step issues a handful of collectives
CAPACITY = 1024
OPS = ("?", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
       "reduce", "barrier")
_OP_CODE = {name: i for i, name in enumerate(OPS)}
#: header: job, step, records written, fault time, fault kind code, dump request, pid,
#: heartbeat (the last ``time.perf_counter()`` the rank's heartbeat thread wrote)
_HDR = struct.Struct("<qqqdqqqd")
_BEAT_AT = struct.calcsize("<qqqdqqq")
#: seconds between heartbeats (a heartbeat older than :data:`.diagnose.STALE_S` means the
#: process is not being scheduled: frozen, stopped, stuck in the kernel)
HEARTBEAT_S = 0.1
#: one record: seq, group mask, op code, step, numel, enter time, exit time (0: in flight)
_REC = struct.Struct("<qQqqqdd")
_SIZE = _HDR.size + CAPACITY * _REC.size
_EXIT_AT = struct.calcsize("<qQqqqd")  # offset of the exit time within a record
FAULT_CODES = ("", "kill", "hang", "skip", "slow", "bitflip", "stall")


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
        _HDR.pack_into(self._mm, 0, job, -1, 0, 0.0, 0, 0, os.getpid(), time.perf_counter())

    def beat(self, t: float) -> None:
        """Write the heartbeat: this process is running (whatever its main thread does)."""
        struct.pack_into("<d", self._mm, _BEAT_AT, t)

    def start_heartbeat(self, interval_s: float = HEARTBEAT_S) -> None:
        """Beat every ``interval_s`` from a daemon thread. It needs the GIL, which gloo's
        waits and torch's kernels release, so a rank blocked inside a collective keeps
        beating and only a process that is not scheduled at all goes quiet."""
        def loop():
            while True:
                self.beat(time.perf_counter())
                time.sleep(interval_s)

        threading.Thread(target=loop, daemon=True, name="labkit-heartbeat").start()

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
    heartbeat: Optional[float] = None

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
    job, step, n, ft, fk, dump, pid, beat = _HDR.unpack_from(buf, 0)
    recs = []
    for i in range(max(0, n - CAPACITY), n):
        seq, mask, op, st, numel, t0, t1 = _REC.unpack_from(buf, _HDR.size + (i % CAPACITY) * _REC.size)
        recs.append(Record(seq, _ranks(mask), OPS[op] if 0 <= op < len(OPS) else "?", st, numel,
                           t0, t1 if t1 else None))
    return RankRecords(rank, job, step, FAULT_CODES[fk] if 0 <= fk < len(FAULT_CODES) else "?",
                       ft or None, recs, pid, dump, beat or None)


def request_dump(path: str) -> None:
    """Ask the rank's dump thread to write torch's Flight Recorder (when enabled)."""
    try:
        with open(path, "r+b") as f:
            f.seek(40)
            f.write(struct.pack("<q", 1))
    except OSError:
        pass
