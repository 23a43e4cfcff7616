"""Per-rank event recording and the merged, cross-rank ``Trace``.

Every rank records two kinds of events on one clock:

* compute regions (``forward``, ``backward``, ``optimizer``, per layer or stage), and
* every communication call made through :mod:`labkit.comm`, with the collective's name,
  algorithmic bytes sent and received, the mesh axis and the peers.

A step that runs under extra instrumentation (the memory tracker makes its step several
times slower) is *flagged*: :func:`flag_step` records a zero-length ``"mark"`` event with
``args["instrumented"]``, and any event carrying that arg flags its step.
:meth:`Trace.instrumented_steps` reads the flags back, so a timeline can say which steps
are not representative instead of letting them pass for ordinary ones.

The clock is ``time.perf_counter()``: on Linux it reads ``CLOCK_MONOTONIC``, which all
processes of one machine share, so events of a local cluster line up without correction.
Under ``torchrun`` across nodes each rank passes an offset measured at a barrier (see
:func:`labkit.worker.clock_offset`). On CUDA a region synchronizes the device at both ends,
so its span covers the kernels it launched, not just their launch.

:class:`Event` and its packing live in :mod:`labkit.trace_event`, :class:`Trace` in
:mod:`labkit.trace_merged`; both are importable from here.
"""
from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

# Event and its packing, and the merged Trace, live in their own modules; every name stays
# importable from here
from labkit.trace_event import (COMM, COMPUTE, MARK, P2P, Event,  # noqa: F401
                                pack_events, unpack_events)
from labkit.trace_merged import Trace  # noqa: F401

__all__ = ["Event", "Tracer", "Trace", "current_tracer", "use_tracer", "region", "flag_step",
           "pack_events", "unpack_events"]


class Tracer:
    """Collects the events of one rank. Cheap enough to stay on for every run.

    Args:
        rank: global rank stamped on each event.
        device: when CUDA, regions synchronize it so spans cover kernel time.
        offset: seconds added to every timestamp (cross-node clock alignment).
        enabled: when False, ``region`` and ``record`` do nothing.

    Threads: a future callback on the backend's thread may close an async call or say
    when the backend finished it. No other thread writes into a recorded event: such a
    time waits under a lock (:meth:`stamp`) until :meth:`record` or :meth:`snapshot`, and a
    rank ships a :meth:`snapshot`: copies no later callback can change, even mid-pickle.
    """

    def __init__(self, rank: int = 0, device=None, offset: float = 0.0, enabled: bool = True):
        self.rank = rank
        self.offset = offset
        self.enabled = enabled
        self.step = -1
        self.events: list[Event] = []
        self._sync = _cuda_sync(device)
        self._lock = threading.Lock()
        #: ``id(event) -> (event, {arg: seconds})``: stamps not yet in their event's args
        self._stamps: dict = {}

    def now(self) -> float:
        return time.perf_counter() + self.offset

    @contextmanager
    def region(self, name: str, cat: str = COMPUTE, **args) -> Iterator[None]:
        """Record a compute span around the ``with`` body."""
        if not self.enabled:
            yield
            return
        self._sync()
        t0 = self.now()
        try:
            yield
        finally:
            self._sync()
            event = Event(self.rank, name, cat, t0, self.now(), self.step, args=args)
            with self._lock:
                self.events.append(event)

    def record(self, event: Event) -> None:
        """Append ``event`` (any thread), with the stamps :meth:`stamp` kept for it."""
        if self.enabled:
            with self._lock:
                event.step = self.step if event.step == -1 else event.step
                _merge(self._stamps.pop(id(event), None))
                self.events.append(event)

    def stamp(self, event: Event, key: str, t: Optional[float] = None) -> None:
        """Note that ``event`` reached ``key`` (e.g. ``"done"``) at ``t`` (seconds on this
        tracer's clock; now when ``None``). Safe on any thread: ``event`` is not touched
        here, the time enters ``event.args[key]`` at :meth:`record` or :meth:`snapshot`."""
        t = self.now() if t is None else t
        if self.enabled:
            with self._lock:
                self._stamps.setdefault(id(event), (event, {}))[1][key] = t

    def snapshot(self) -> list[Event]:
        """Copies of the recorded events (each with its own ``args`` dict), with every stamp
        that has arrived merged in first: the consistent view a rank ships to its parent.
        A stamp arriving later waits for the next snapshot; it never changes a copy."""
        with self._lock:
            for pending in self._stamps.values():
                _merge(pending)
            self._stamps.clear()
            return [dataclasses.replace(e, args=dict(e.args)) for e in self.events]

    def packed(self) -> list:
        """What a rank sends its parent: :meth:`snapshot`, as :func:`pack_events` rows."""
        return pack_events(self.snapshot())

    def flag_step(self, instrumented: str, **args) -> None:
        """Flag the current step as run under ``instrumented`` (e.g. ``"memory"``): a
        zero-length ``"mark"`` event with ``args["instrumented"]``. Views show such a step
        as not representative of step time."""
        now = self.now()
        self.record(Event(self.rank, f"instrumented: {instrumented}", MARK, now, now,
                          args={"instrumented": instrumented, **args}))


def _merge(pending) -> None:
    """Write a :meth:`Tracer.stamp` entry ``(event, {key: t})`` into its event's args."""
    if pending is not None:
        event, times = pending
        event.args.update(times)


def _cuda_sync(device):
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


_current: contextvars.ContextVar[Optional[Tracer]] = contextvars.ContextVar(
    "labkit_tracer", default=None)


def current_tracer() -> Optional[Tracer]:
    """The tracer of the job running in this process, or ``None`` outside a job."""
    return _current.get()


@contextmanager
def use_tracer(tracer: Optional[Tracer]) -> Iterator[Optional[Tracer]]:
    """Make ``tracer`` the one :mod:`labkit.comm` and :func:`region` record into."""
    token = _current.set(tracer)
    try:
        yield tracer
    finally:
        _current.reset(token)


@contextmanager
def region(name: str, cat: str = COMPUTE, **args) -> Iterator[None]:
    """``current_tracer().region(...)``, or nothing when no tracer is active."""
    tracer = _current.get()
    if tracer is None:
        yield
    else:
        with tracer.region(name, cat, **args):
            yield


def flag_step(instrumented: str, **args) -> None:
    """``current_tracer().flag_step(...)``, or nothing outside a traced job."""
    tracer = _current.get()
    if tracer is not None:
        tracer.flag_step(instrumented, **args)
