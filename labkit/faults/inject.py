"""The rank side of fault injection: this rank's faults, applied at the points they name.

The training job calls :func:`arm` with the run's faults before its first step and
:func:`disarm` after; :func:`on_step` runs at the start of each step (``kill``, ``slow``),
:func:`on_collective` inside :mod:`labkit.comm` before an op reaches the backend
(``hang``, ``skip``), :func:`after_enter` once the flight record holds it (``stall``),
:func:`flip` after the gradient reduction and after the optimizer (``bitflip``). With
nothing armed each hook is one attribute test.

Every fault stamps its moment into the rank's flight record first
(:meth:`labkit.faults.recorder.FlightRecorder.note_fault`), so the cluster can measure how
long it took to notice.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch

from . import recorder

__all__ = ["arm", "disarm", "armed", "on_step", "on_collective", "after_enter", "flip",
           "flip_bit"]

_armed: list = []
_step = -1
_fired: set = set()


def arm(faults, rank: int) -> None:
    """Arm the faults of ``faults`` (``FaultSpec`` s) that are for ``rank``."""
    global _step
    _armed[:] = [f for f in faults if f.rank == rank]
    _fired.clear()
    _step = -1


def disarm() -> None:
    global _step
    _armed.clear()
    _fired.clear()
    _step = -1


def armed() -> bool:
    return bool(_armed)


def _stamp(kind: str) -> None:
    rec = recorder.active()
    if rec is not None:
        rec.note_fault(kind, time.perf_counter())


def on_step(step: int) -> None:
    """Start of ``step``: record it; SIGKILL this rank or add a straggler's delay."""
    global _step
    _step = step
    rec = recorder.active()
    if rec is not None:
        rec.set_step(step)
    for f in _armed:
        if f.kind == "kill" and f.step == step:
            _stamp("kill")
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no message: a lost host
        elif f.kind == "slow" and step >= f.step:
            if f.step == step:
                _stamp("slow")
            time.sleep(f.delay_s)


def on_collective(op: str) -> bool:
    """Before collective ``op`` reaches the backend. Stalls (``hang``) or returns True when
    this call must be skipped (``skip``)."""
    for f in _armed:
        if f.step != _step or id(f) in _fired:
            continue
        if f.kind == "hang":
            _fired.add(id(f))
            _stamp("hang")
            end = time.monotonic() + (f.seconds if f.seconds is not None else 1e9)
            while time.monotonic() < end:  # stalled: the watchdog kills this process
                time.sleep(0.05)
        elif f.kind == "skip" and op == f.op:
            _fired.add(id(f))
            _stamp("skip")
            return True
    return False


def after_enter(op: str) -> None:
    """The collective ``op`` is in this rank's flight record: an armed ``stall`` freezes the
    whole process here (``SIGSTOP``: every thread, the heartbeat too) until it is killed."""
    for f in _armed:
        if f.kind == "stall" and f.step == _step and id(f) not in _fired:
            _fired.add(id(f))
            _stamp("stall")
            os.kill(os.getpid(), signal.SIGSTOP)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` of the fp32 element ``index`` of ``t`` (flat), in place.

    Raises:
        ValueError: ``t`` is not fp32 or has no element ``index``.
    """
    if t.dtype != torch.float32:
        raise ValueError(f"bit flip needs an fp32 tensor, got {t.dtype}")
    flat = t.detach().view(-1)
    if index >= flat.numel():
        raise ValueError(f"bit flip index={index} but the tensor has {flat.numel()} elements")
    word = flat[index:index + 1].view(torch.int32)
    word ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def flip(step: int, target: str, params, attempt: int = 0) -> Optional[str]:
    """Apply this rank's ``bitflip`` at ``step`` to ``target`` (``"grad"`` or ``"param"``)
    of the first of ``params``; ``attempt`` > 0 is a re-run of the step, where only a
    persistent fault flips again. Returns what was flipped, or ``None``."""
    for f in _armed:
        if f.kind != "bitflip" or f.step != step or f.target != target:
            continue
        if attempt and not f.persistent:
            continue
        p = params[0]
        t = p.grad if target == "grad" else p.data
        if t is None:
            return None
        flip_bit(t, f.index, f.bit)
        _stamp("bitflip")
        return f"bit {f.bit} of {target}[{f.index}] flipped at step {step}"
    return None
