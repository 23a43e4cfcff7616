"""Silent data corruption: a cheap cross-replica fingerprint, and a re-run that tells a
transient fault from a persistent one.

Data-parallel replicas hold bitwise-equal reduced gradients (every rank receives the same
all-reduce result) and so bitwise-equal parameters after the optimizer. A bit flipped in
one replica's memory or arithmetic — Llama 3's "silent data corruption", which raises no
error (Dubey et al. 2024, §3.3.4) — breaks that equality. Every ``fingerprint_every``
steps each replica sums its fp32 words as int32 into an int64 (exact: any single flipped
bit changes the sum) and the replicas all-gather the sums (8 bytes per rank per check).

* reduced gradients, before the optimizer: on a mismatch the step's forward and backward
  run again on the same batch from the same parameters (deterministic on CPU ranks). A
  replica whose sum changed between the two runs had a *transient* fault; the re-run's
  gradients are good and training continues as if nothing happened. If the replicas
  still disagree the fault is *persistent* (a bad chip): :class:`SilentDataCorruption`
  is raised on every rank alike, naming the rank (by majority when ``dp >= 3``). This is
  the idea of Megatron-Core's re-run state machine (``megatron/core/rerun_state_machine.py``),
  which re-runs a step whose loss looks wrong; here the replicas are the oracle.
* parameters, after the optimizer: a mismatch cannot be re-run away; it is raised.

A flip *before* the gradient all-reduce is invisible to this check: the reduction spreads
it to every replica alike, so they still agree (only a re-run or a loss spike shows it).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import comm
from . import inject

__all__ = ["checksum", "SilentDataCorruption", "ReplicaCheck", "SdcEvent"]


def checksum(tensors) -> int:
    """Sum of the tensors' fp32 words read as int32, in int64: one flipped bit anywhere
    changes it by ±2^bit (no overflow below 2^32 words). Tensors that are ``None`` count
    as nothing. Raises ``ValueError`` for a tensor that is not fp32."""
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        if t is None:
            continue
        if t.dtype != torch.float32:
            raise ValueError(f"checksum needs fp32 tensors, got {t.dtype}")
        total += t.detach().contiguous().view(torch.int32).sum(dtype=torch.int64).cpu()
    return int(total)


class SilentDataCorruption(RuntimeError):
    """Replicas disagree and a re-run did not fix it (persistent), or their parameters
    diverged. Raised on every replica alike."""


@dataclass
class SdcEvent:
    """One detected corruption: ``step``, ``what`` (``"grad"``/``"param"``), ``ranks`` (the
    replicas at fault, global), ``verdict`` (``"transient"``, ``"persistent"``,
    ``"diverged"``) and the checksums seen (``{rank: sum}``, per run)."""

    step: int
    what: str
    ranks: tuple
    verdict: str
    sums: list = field(default_factory=list)

    def __str__(self) -> str:
        return (f"step {self.step}: {self.what} of rank{'s' if len(self.ranks) != 1 else ''} "
                f"{list(self.ranks)} differed from the other replicas: {self.verdict}")


def _odd_ones(sums: dict) -> tuple:
    """Ranks whose sum is not the most common one (all of them on a tie)."""
    counts = Counter(sums.values())
    top = counts.most_common()
    if len(top) > 1 and top[0][1] == top[1][1]:
        return tuple(sorted(sums))
    return tuple(sorted(r for r, v in sums.items() if v != top[0][0]))


class ReplicaCheck:
    """The fingerprint of one rank's data-parallel wrappers.

    Args:
        wrappers: labkit's DDP wrappers of the rank (each has ``params`` and ``group``:
            the replicas of those parameters).
        every: check every this many steps (steps ``0, every, 2·every …``).
        rank: this rank's global rank.
    """

    def __init__(self, wrappers, every: int, rank: int):
        self.units = [([p for _, p in w.params], w.group, getattr(w, "axis", None))
                      for w in wrappers if hasattr(w, "params") and hasattr(w, "group")]
        self.every, self.rank = every, rank
        self.events: list = []
        self.checks = 0
        self.seconds = 0.0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def _sums(self, what: str) -> list:
        """``[{global rank: checksum}]`` per unit, all-gathered over its replicas."""
        t0 = time.perf_counter()
        out = []
        for params, group, axis in self.units:
            mine = checksum(p.grad if what == "grad" else p.data for p in params)
            ranks = comm.group_ranks(group)
            buf = torch.empty(len(ranks), dtype=torch.int64)
            comm.all_gather(buf, torch.tensor([mine], dtype=torch.int64), group=group,
                            axis=axis, fingerprint=what)
            out.append(dict(zip(ranks, buf.tolist())))
        self.checks += 1
        self.seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def _bad(sums: list) -> Optional[dict]:
        return next((s for s in sums if len(set(s.values())) > 1), None)

    def check_grads(self, step: int, rerun: Callable[[], None]) -> None:
        """Compare the reduced gradients; on a mismatch call ``rerun()`` (zero the
        gradients, forward, backward, reduce again) and compare again.

        Raises:
            SilentDataCorruption: the replicas still disagree after the re-run.
        """
        first = self._sums("grad")
        bad = self._bad(first)
        if bad is None:
            return
        rerun()
        second = self._sums("grad")
        again = self._bad(second)
        if again is None:
            changed = tuple(sorted(r for a, b in zip(first, second) for r in a if a[r] != b[r]))
            self.events.append(SdcEvent(step, "grad", changed or _odd_ones(bad), "transient",
                                        [first, second]))
            return
        ev = SdcEvent(step, "grad", _odd_ones(again), "persistent", [bad, again])
        self.events.append(ev)
        raise SilentDataCorruption(
            f"silent data corruption: {ev}; the re-run of step {step} gave the same "
            f"disagreement (checksums {again}), so it is not a one-off flip: take rank(s) "
            f"{list(ev.ranks)} out of service" + ("" if len(again) > 2 else
                                                  " (with 2 replicas the faulty one cannot be "
                                                  "told from the good one: a third would)"))

    def check_params(self, step: int) -> None:
        """Compare the parameters after the optimizer.

        Raises:
            SilentDataCorruption: the replicas' parameters differ.
        """
        sums = self._sums("param")
        bad = self._bad(sums)
        if bad is None:
            return
        ev = SdcEvent(step, "param", _odd_ones(bad), "diverged", [bad])
        self.events.append(ev)
        raise SilentDataCorruption(
            f"silent data corruption: {ev} after the optimizer (checksums {bad}): the replicas "
            "no longer hold the same model; resume from the last checkpoint")

    def summary(self) -> dict:
        """Plain data for the run's metrics."""
        return {"every": self.every, "checks": self.checks, "seconds": self.seconds,
                "events": [dict(step=e.step, what=e.what, ranks=list(e.ranks),
                                verdict=e.verdict, text=str(e)) for e in self.events]}


def flip_and_check(check: Optional[ReplicaCheck], step: int, params, compute: Callable,
                   zero: Callable) -> None:
    """After the gradient reduction of ``step``: apply an armed ``grad`` bit flip, then
    (when due) compare replicas, re-running ``compute()`` after ``zero()`` on a mismatch
    (a persistent flip strikes the re-run again)."""
    inject.flip(step, "grad", params)
    if check is None or not check.due(step):
        return

    def rerun() -> None:
        zero()
        compute()
        inject.flip(step, "grad", params, attempt=1)

    check.check_grads(step, rerun)
