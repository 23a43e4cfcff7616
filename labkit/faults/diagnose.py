"""Which rank hung where, from every rank's flight record (:mod:`.recorder`).

A hang is one of two kinds, and the records tell them apart:

* **a member is missing** — some ranks of a group entered its ``seq``-th collective and
  another never did (it skipped one, stalled before it, or died): the report names the
  missing rank, where it is, and where the group's sequences first diverge;
* **a stall inside the backend** — every member entered the collective and none left (a
  frozen process, a lost link, a wedged NIC, a collective the backend cannot finish). Nobody
  is missing, so the report says what the records still show: when each member entered
  (and which entered last), each member's last completed collective, and each process's
  heartbeat (a thread beating every 0.1 s: a process whose heartbeat stopped is not being
  scheduled — frozen, stopped, stuck in the kernel — and is the one the others wait for).
  When every heartbeat is live, every rank is waiting on the backend or the network and no
  rank can be blamed from the records alone; the report says so.

The kernel's own view of each process (``/proc/PID/stat``: ``R`` running, ``S`` sleeping,
``T`` stopped, ``D`` in uninterruptible I/O) is added where the caller passes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["HangReport", "diagnose", "divergences", "STALE_S", "process_state"]

#: a heartbeat older than this (seconds; 10 beats) means the process is not running
STALE_S = 1.0
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped",
           "t": "stopped by a tracer", "Z": "a zombie (exited)", "I": "idle"}


def process_state(pid: int) -> Optional[str]:
    """The kernel's state of ``pid`` in words (``/proc/PID/stat``), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return f"{_STATES.get(code, code)} ({code})"


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
        missing: ranks of the group that never entered it (empty: a stall in the backend).
        waited_s: how long the earliest entrant has been waiting (seconds).
        where: ``{missing rank: where it is}`` in words.
        divergence: when a missing rank issued the group's collectives out of step with the
            others (a skipped or extra collective), the first sequence number at which they
            disagree and how; else ``None``.
        entered_at: ``{rank: seconds after the first member entered}`` (``perf_counter``).
        last_entered: the member that entered last.
        last_done: ``{rank: its last completed collective, in words}``.
        heartbeat_age_s: ``{rank: seconds since its heartbeat}`` (``None``: never beat).
        frozen: members whose heartbeat is older than :data:`STALE_S` (not running).
        proc_state: ``{rank: the kernel's state of the process}`` where known.
        numel: elements of the stuck collective (as the first entrant issued it).
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
    entered_at: dict = field(default_factory=dict)
    last_entered: Optional[int] = None
    last_done: dict = field(default_factory=dict)
    heartbeat_age_s: dict = field(default_factory=dict)
    frozen: tuple = ()
    proc_state: dict = field(default_factory=dict)
    numel: int = 0

    @property
    def in_backend(self) -> bool:
        """True when every member entered and none left: the stall is inside the backend."""
        return not self.missing

    @property
    def culprit(self) -> Optional[int]:
        """The one rank the others wait for, when the records single it out: the one
        missing rank, or the one frozen member of a stall in the backend; else ``None``."""
        if len(self.missing) == 1:
            return self.missing[0]
        if self.in_backend and len(self.frozen) == 1:
            return self.frozen[0]
        return None

    def __str__(self) -> str:
        head = f"{self.op} #{self.seq} on group {list(self.group)} (step {self.step}): "
        if not self.in_backend:
            lines = [head + f"ranks {list(self.entered)} entered it and waited "
                     f"{self.waited_s:.1f} s; rank{'s' if len(self.missing) != 1 else ''} "
                     f"{list(self.missing)} never did"]
            lines += [f"  rank {r}: {w}" for r, w in sorted(self.where.items())]
            if self.divergence:
                lines.append(f"  {self.divergence}")
            return "\n".join(lines)
        times = ", ".join(f"rank {r} at +{t * 1e3:.1f} ms" for r, t in
                          sorted(self.entered_at.items(), key=lambda kv: kv[1]))
        lines = [head + f"every member entered it ({times}; rank {self.last_entered} last) "
                 f"and none completed it in {self.waited_s:.1f} s: a stall inside the backend"]
        for r in self.group:
            age = self.heartbeat_age_s.get(r)
            beat = ("no heartbeat" if age is None else
                    f"heartbeat stopped {age:.1f} s ago: the process is not running"
                    if r in self.frozen else f"heartbeat live ({age:.2f} s ago), waiting")
            state = f"; kernel: {self.proc_state[r]}" if self.proc_state.get(r) else ""
            lines.append(f"  rank {r}: {beat}{state}; {self.last_done.get(r, '')}")
        if self.culprit is not None:
            lines.append(f"  => the others wait for rank {self.culprit}, frozen inside "
                         f"{self.op} #{self.seq}")
        elif self.frozen:
            lines.append(f"  => ranks {list(self.frozen)} are frozen")
        else:
            lines.append(f"  => every member is alive and waiting: the backend or the network "
                         f"is stalled; no rank can be blamed from the records (rank "
                         f"{self.last_entered} entered last)")
        return "\n".join(lines)


def _where(rr, group: tuple, alive: bool) -> str:
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


def _last_done(rr, t0: float) -> str:
    done = [x for x in rr.records if x.t_exit is not None] if rr is not None else []
    if not done:
        return "completed no collective in this job"
    x = max(done, key=lambda x: x.t_exit)
    return (f"last completed {x.op} #{x.seq} on group {list(x.group)} (step {x.step}), "
            f"left at {(x.t_exit - t0) * 1e3:+.1f} ms")


def diagnose(by_rank: dict, now: float, alive: Optional[dict] = None,
             states: Optional[dict] = None) -> Optional[HangReport]:
    """The collective a hang is stuck in, from every rank's
    :class:`~labkit.faults.recorder.RankRecords`.

    The stuck collective is the oldest one still in flight on some rank whose group has a
    member that has not entered it; when every member of every in-flight collective entered
    it, the oldest of those (a stall inside the backend: see the module docstring). Returns
    ``None`` when no rank is inside a collective.

    Args:
        by_rank: ``{rank: RankRecords or None}`` for the job's ranks.
        now: the current ``time.perf_counter()`` (heartbeat ages and waits are from it).
        alive: ``{rank: bool}``, whether each process is still running.
        states: ``{rank: the kernel's state in words}`` (:func:`process_state`), optional.
    """
    alive = alive or {}
    stuck = [(rec, r) for r, rr in by_rank.items() if rr is not None for rec in rr.in_flight()]
    if not stuck:
        return None
    candidates = []
    for rec, r in stuck:
        members = rec.group
        entered = tuple(m for m in members if by_rank.get(m) is not None and any(
            x.group == members and x.seq == rec.seq for x in by_rank[m].records))
        missing = tuple(m for m in members if m not in entered)
        candidates.append((bool(missing), -rec.t_enter, rec, entered, missing))
    # a group with a missing member first; among those the longest wait
    _, _, rec, entered, missing = max(candidates, key=lambda c: (c[0], c[1]))
    waited = max(now - x.t_enter for x, r in stuck if x.group == rec.group and x.seq == rec.seq)
    where = {m: _where(by_rank.get(m), rec.group, alive.get(m, True)) for m in missing}
    report = HangReport(rec.op, rec.group, rec.seq, rec.step, entered, missing, waited, where,
                        _divergence(by_rank, rec.group), numel=rec.numel)
    if missing:
        return report
    t_in = {m: next(x.t_enter for x in by_rank[m].records
                    if x.group == rec.group and x.seq == rec.seq) for m in rec.group}
    t0 = min(t_in.values())
    report.entered_at = {m: t - t0 for m, t in t_in.items()}
    report.last_entered = max(t_in, key=t_in.get)
    report.last_done = {m: _last_done(by_rank[m], t0) for m in rec.group}
    report.heartbeat_age_s = {m: (None if by_rank[m].heartbeat is None
                                  else now - by_rank[m].heartbeat) for m in rec.group}
    report.frozen = tuple(m for m, a in report.heartbeat_age_s.items()
                          if a is None or a > STALE_S or not alive.get(m, True))
    report.proc_state = {m: s for m, s in (states or {}).items() if m in rec.group and s}
    return report


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
