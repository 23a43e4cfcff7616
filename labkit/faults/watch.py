"""The cluster's side of fault detection: a dead rank named, a hang diagnosed.

:class:`Watch` reads the flight records of a running job (:mod:`.recorder`) from the
pool's folder. :class:`labkit.Cluster` asks it

* after any rank error, whether a rank *process* died: a SIGKILLed rank makes its peers'
  gloo calls fail too ("connection closed by peer"), and the dead one, not the first to
  report, is the fault — :class:`RankDied`;
* at every poll of a job with ``watchdog_s``, whether a rank has waited inside a collective
  longer than that, and if so which collective, which group, which sequence number, who
  entered and who did not, or, when all entered, who is frozen — :class:`CollectiveHang`;
* at every poll of a job with ``straggler_s``, whether a rank keeps entering its
  collectives last and that late (:func:`~.straggler.live_stragglers`): reported, not
  stopped.

Detection bounds (stated, and checked structurally in tests/test_faults.py): a killed rank
within the cluster's poll (0.5 s) plus :data:`DEATH_GRACE_S`; a hang within
``watchdog_s`` plus one poll plus, when torch's Flight Recorder is on, its dump
(:data:`DUMP_WAIT_S`); a straggler within one poll (0.25 s while watching for them) after
it entered, late, a collective of the third of its group's last four steps in which it kept
its peers waiting more than ``straggler_s``.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Optional

from ..result import RankError
from .diagnose import HangReport, diagnose, divergences, process_state
from .recorder import read_records, request_dump
from .straggler import live_stragglers

__all__ = ["FaultEvent", "RankDied", "CollectiveHang", "Watch", "DEATH_GRACE_S", "DUMP_WAIT_S",
           "fr_agreement"]

#: after a rank reports an error, seconds to wait for a peer's process to be seen dead
DEATH_GRACE_S = 1.0
#: after any other rank error, seconds to look for a dead process
SHORT_GRACE_S = 0.3
#: words of a gloo error caused by a peer that went away
_LOST_PEER = ("connection closed", "connection reset", "broken pipe", "peer", "gloo",
              "timed out")
#: seconds to wait for the ranks to write torch's Flight Recorder before killing them
DUMP_WAIT_S = 1.5


@dataclass
class FaultEvent:
    """One fault the cluster detected.

    Attributes:
        kind: ``"killed"`` (a rank process died), ``"hang"`` (the watchdog fired),
            ``"timeout"`` (the job's timeout fired), ``"error"`` (a rank raised) or
            ``"straggler"`` (a slow rank, seen live; the job goes on).
        rank: the rank at fault (``None`` when it cannot be told).
        step: the step that rank was in (-1 before the first step).
        detected_at: ``time.perf_counter()`` when the cluster noticed.
        injected_at: when an injected fault fired (from the rank's flight record), else
            ``None``.
        message: what happened, in words.
        hang: the :class:`HangReport`, for a hang.
    """

    kind: str
    rank: Optional[int]
    step: int
    detected_at: float
    injected_at: Optional[float] = None
    message: str = ""
    hang: Optional[HangReport] = None
    extra: dict = field(default_factory=dict)

    @property
    def detect_s(self) -> Optional[float]:
        """Seconds from the injected fault to its detection (``None`` if not injected)."""
        return None if self.injected_at is None else self.detected_at - self.injected_at


class RankDied(RankError):
    """A rank process died during a job (killed, out of memory, crashed in native code).
    ``fault`` is the :class:`FaultEvent`."""

    def __init__(self, fault: FaultEvent, remote_traceback: str, job: str = ""):
        self.fault = fault
        self.rank, self.remote_traceback, self.job = fault.rank, remote_traceback, job
        first, _, rest = fault.message.partition("\n")
        RuntimeError.__init__(self, f"{first} during job {job}; the pool was restarted"
                                    f"{chr(10) + rest if rest else ''}\n\n--- what the ranks "
                                    f"reported ---\n{remote_traceback}")


class CollectiveHang(TimeoutError):
    """Ranks waited inside a collective longer than ``watchdog_s``. ``fault.hang`` is the
    :class:`HangReport` (which rank hung where)."""

    def __init__(self, fault: FaultEvent):
        self.fault = fault
        super().__init__(fault.message)


def _signal_name(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Watch:
    """The flight records of one job on one pool.

    Args:
        folder: the pool's private folder (``Cluster._tmp``).
        procs: the rank processes.
        nranks: ranks running the job.
        watchdog_s: seconds inside one collective before a hang is declared (``None``: off).
        straggler_s: lateness that makes a straggler (:func:`~.straggler.live_stragglers`;
            ``None``: off).
        torch_fr: the ranks record torch's Flight Recorder (they started with
            ``TORCH_FR_BUFFER_SIZE`` set): dump and compare it on a hang.
    """

    def __init__(self, folder: str, procs: list, nranks: int, watchdog_s: Optional[float],
                 straggler_s: Optional[float] = None, torch_fr: bool = False):
        self.folder, self.procs, self.nranks, self.watchdog_s = folder, procs, nranks, watchdog_s
        self.straggler_s, self.torch_fr = straggler_s, torch_fr
        #: seconds between the cluster's looks (shorter while watching for stragglers)
        self.poll_s = 0.25 if straggler_s else 0.5
        #: the stragglers reported so far in this job (each rank once)
        self.live: list = []

    def stragglers(self) -> list:
        """New stragglers of the running job (:func:`~.straggler.live_stragglers`, each
        rank once per job) as ``"straggler"`` :class:`FaultEvent` s; ``[]`` when the job's
        config sets no ``straggler_s``."""
        if not self.straggler_s:
            return []
        now = time.perf_counter()
        recs = self.records()
        seen = {e.rank for e in self.live}
        new = []
        for s in live_stragglers(recs, self.straggler_s):
            if s.rank in seen:
                continue
            rr = recs.get(s.rank)
            injected = rr.fault_t if rr is not None and rr.fault == "slow" else None
            new.append(FaultEvent("straggler", s.rank, s.step, now, injected, str(s),
                                  extra={"straggler": s}))
        self.live += new
        return new

    def records(self) -> dict:
        return {r: read_records(os.path.join(self.folder, f"flight{r}"), r)
                for r in range(self.nranks)}

    def alive(self) -> dict:
        return {r: self.procs[r].is_alive() for r in range(self.nranks)}

    def death(self, error: str = "", grace_s: float = DEATH_GRACE_S) -> Optional[FaultEvent]:
        """A dead rank process. When ``error`` (a rank's traceback) is a lost connection,
        wait up to ``grace_s`` for the peer that caused it to be seen dead."""
        now = time.perf_counter()
        sentinels = [p.sentinel for p in self.procs]
        if all(p.is_alive() for p in self.procs):
            # a peer's failure reported first: give the dead process time to be seen (a
            # short look for any error; the lost-connection ones wait the full grace)
            lost = any(w in error.lower() for w in _LOST_PEER)
            mp_wait(sentinels, grace_s if lost else SHORT_GRACE_S)
        dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
        if not dead:
            return None
        recs = self.records()
        # several dead (a cascade): the one that stamped an injected fault, else the first
        rank = next((r for r in dead if recs.get(r) and recs[r].fault), dead[0])
        p = self.procs[rank]
        p.join(timeout=1)
        rr = recs.get(rank)
        step = rr.step if rr else -1
        msg = (f"rank {rank} (pid {p.pid}) {_signal_name(p.exitcode)} in step {step}"
               + (f"; also dead: ranks {[r for r in dead if r != rank]}" if len(dead) > 1 else ""))
        for d in divergences(recs):  # a collective mismatch that made gloo abort it
            msg += f"\n  {d}"
        return FaultEvent("killed", rank, step, now, rr.fault_t if rr else None, msg,
                          extra={"exitcode": p.exitcode})

    def hang(self, force: bool = False) -> Optional[FaultEvent]:
        """A collective some ranks have waited in longer than ``watchdog_s`` (``force``:
        any wait, as when the job's timeout fired), diagnosed; else ``None``."""
        if self.watchdog_s is None and not force:
            return None
        now = time.perf_counter()
        recs = self.records()
        alive = self.alive()
        states = {r: process_state(self.procs[r].pid) for r in range(self.nranks)}
        report = diagnose(recs, now, alive, states)
        if report is None or (not force and report.waited_s < self.watchdog_s):
            return None
        suspects = report.missing or report.frozen or report.group
        injected = next((recs[r].fault_t for r in suspects
                         if recs.get(r) and recs[r].fault), None)
        # a frozen or dead process cannot answer: do not wait for it
        quiet = set(report.frozen) | {r for r, a in alive.items() if not a}
        torch_fr = self._dump_torch_fr(quiet) if self.torch_fr else {}
        msg = f"hang: {report}"
        if self.torch_fr:
            msg += "\n" + fr_agreement(report, torch_fr)
        return FaultEvent("hang", report.culprit, report.step, now, injected, msg, report,
                          extra={"torch_fr": torch_fr})

    def _dump_torch_fr(self, quiet: set = frozenset()) -> dict:
        """Ask every rank for torch's Flight Recorder; ``{rank: (process group, its
        collective seq id, op, state)}`` of each rank's last entry, for the ranks that
        answered within :data:`DUMP_WAIT_S` (the pool's folder is deleted on restart, so
        the dumps are read now); ``quiet`` ranks (frozen, dead) are not waited for."""
        for r in range(self.nranks):
            request_dump(os.path.join(self.folder, f"flight{r}"))
        deadline, out = time.perf_counter() + DUMP_WAIT_S, {}
        while time.perf_counter() < deadline and len(out) < self.nranks - len(quiet):
            for r in range(self.nranks):
                rr = read_records(os.path.join(self.folder, f"flight{r}"), r)
                path = os.path.join(self.folder, f"torch_fr{r}.pkl")
                if r not in out and rr is not None and rr.dump_state == 2 \
                        and os.path.exists(path):
                    out[r] = _last_entry(path)
            time.sleep(0.05)
        return out


def _last_entry(path: str):
    import pickle

    try:
        with open(path, "rb") as f:
            entries = pickle.load(f).get("entries", [])
    except Exception as exc:  # noqa: BLE001 - a dump we cannot read is reported as such
        return f"unreadable ({exc})"
    if not entries:
        return "no entries"
    e = entries[-1]
    return (e.get("process_group"), e.get("collective_seq_id"), e.get("profiling_name"),
            e.get("state"), e.get("input_sizes"))


def fr_agreement(report: HangReport, torch_fr: dict) -> str:
    """Whether torch's Flight Recorder agrees with labkit's diagnosis, in words.

    Every member that entered the stuck collective and answered must have, as its last
    entry, that op with that element count and one common sequence id S (torch counts a
    process group's collectives over its whole life, so members agree on S); a missing
    member that answered must have stopped before S (on that group); a frozen member cannot
    answer (its dump thread is frozen too). gloo's entries stay ``scheduled`` in torch 2.13
    (it marks no gloo collective completed), so torch tells which op each rank issued
    last, not whether it finished."""
    lines, ok, seqs, pg = [], True, set(), None
    for r in report.entered:
        last = torch_fr.get(r)
        if not isinstance(last, tuple):
            ok &= r in report.frozen  # only a frozen process may stay silent
            lines.append(f"rank {r}: {'did not answer' if last is None else last}"
                         f"{' (it is frozen)' if r in report.frozen else ''}")
            continue
        pg, seq, name, state, sizes = last
        numel = sum(math.prod(s) for s in sizes or [])
        ok &= name == f"gloo:{report.op}" and numel == report.numel
        seqs.add(seq)
        lines.append(f"rank {r}: last {name} #{seq} of {numel} elements ({state})")
    ok &= len(seqs) <= 1
    for r in report.missing:
        last = torch_fr.get(r)
        if isinstance(last, tuple):
            ok &= bool(seqs) and (last[0] != pg or last[1] < min(seqs))
            lines.append(f"rank {r}: last {last[2]} #{last[1]} (before the stuck one)")
        else:
            lines.append(f"rank {r}: did not answer")
    verdict = "agrees" if ok else "DISAGREES"
    return f"  torch Flight Recorder {verdict}: " + "; ".join(lines)
