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
"""
from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Optional

__all__ = ["Event", "Tracer", "Trace", "current_tracer", "use_tracer", "region", "flag_step",
           "pack_events", "unpack_events"]

COMPUTE, COMM, P2P = "compute", "comm", "p2p"
#: zero-length annotations (e.g. "this step is instrumented"), not spans of work
MARK = "mark"


@dataclass
class Event:
    """One span on one rank.

    Attributes:
        rank: the global rank that recorded it.
        name: what ran, e.g. ``"forward"``, ``"layers.1.backward"``, ``"all_reduce"``.
        cat: ``"compute"``, ``"comm"`` (collective), ``"p2p"`` (send/recv) or ``"mark"``
            (a zero-length annotation, see :func:`flag_step`).
        start, end: seconds on the shared clock.
        step: training step the event belongs to (-1 outside a step).
        op: collective or point-to-point op (``"all_reduce"``, ``"send"`` …).
        bytes_sent, bytes_recv: algorithmic bytes this rank moved (ring formulas; see
            :mod:`labkit.comm` for why these are not gloo's wire bytes).
        axis: mesh axis of the group (``"dp"``, ``"tp"`` …) or ``None``.
        peers: global ranks of the group (collectives) or the other end (p2p).
        args: anything else worth showing (bucket id, dtype, numel, async …).
    """

    rank: int
    name: str
    cat: str
    start: float
    end: float
    step: int = -1
    op: Optional[str] = None
    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    axis: Optional[str] = None
    peers: tuple = ()
    args: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.end - self.start


def pack_events(events: Iterable[Event]) -> list:
    """``events`` as plain tuples in :class:`Event`'s field order, for sending between
    processes: pickling tuples costs about half of pickling the dataclasses (a warm rank
    sends a few hundred events after every job)."""
    return [(e.rank, e.name, e.cat, e.start, e.end, e.step, e.op, e.bytes_sent, e.bytes_recv,
             e.axis, e.peers, e.args) for e in events]


def unpack_events(rows: Iterable[tuple]) -> list:
    """The :class:`Event` objects :func:`pack_events` packed."""
    return [Event(*row) for row in rows]


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


class Trace:
    """The events of all ranks of one run, merged and sorted by start time.

    Times are kept on the shared clock; ``t0`` is the earliest start, and exports shift to
    it so a timeline starts at zero.
    """

    def __init__(self, events: Iterable[Event] = ()):
        self.events: list[Event] = sorted(events, key=lambda e: (e.start, e.rank))
        self.t0 = self.events[0].start if self.events else 0.0

    @classmethod
    def merge(cls, per_rank: Iterable[Iterable[Event]]) -> "Trace":
        return cls(e for events in per_rank for e in events)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def filter(self, rank=None, cat=None, op=None, step=None, name=None) -> list[Event]:
        """Events matching every argument that is not ``None``."""
        return [e for e in self.events
                if (rank is None or e.rank == rank) and (cat is None or e.cat == cat)
                and (op is None or e.op == op) and (step is None or e.step == step)
                and (name is None or e.name == name)]

    def instrumented_steps(self) -> dict:
        """``{step: what}`` for the steps flagged as instrumented (see :func:`flag_step`):
        any event whose ``args`` has ``"instrumented"`` flags its step."""
        out: dict = {}
        for e in self.events:
            what = (e.args or {}).get("instrumented")
            if what and e.step >= 0:
                out.setdefault(e.step, str(what))
        return out

    def comm_bytes(self, rank: int, op=None, step=None, direction: str = "sent") -> float:
        """Bytes ``rank`` sent (or received) through labkit.comm, optionally per op/step."""
        key = "bytes_sent" if direction == "sent" else "bytes_recv"
        return sum(getattr(e, key) for e in self.events
                   if e.rank == rank and e.cat in (COMM, P2P)
                   and (op is None or e.op == op) and (step is None or e.step == step))

    def busy_time(self, rank: int, cat: str = COMPUTE, step=None) -> float:
        """Seconds of ``cat`` spans on ``rank``, overlaps merged (nested regions count once)."""
        spans = sorted((e.start, e.end) for e in self.filter(rank=rank, cat=cat, step=step))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + ((cur_e - cur_s) if cur_e is not None else 0.0)

    def overlap_fraction(self, rank: int, op: str = "all_reduce",
                         under: tuple = ("backward",), step=None, axis=None) -> float:
        """Fraction (0–1) of ``rank``'s ``op`` time that ran while a compute region named in
        ``under`` was open: communication hidden behind computation. 0 when there is no
        ``op`` time.

        ``axis`` (a mesh axis name, or a tuple of names) keeps only the calls on it: in a
        composition the same op runs on several axes (data-parallel bucket all-reduces
        beside tensor-parallel ones), and ``None`` counts them all.

        For async ops the span runs from issue to ``wait()``, so this measures how much of
        the in-flight window the computation covered (on gloo the transfer itself runs on
        a background thread in that window).
        """
        axes = (axis,) if isinstance(axis, str) else axis
        comm = [(e.start, e.end) for e in self.filter(rank=rank, op=op, step=step)
                if axes is None or e.axis in axes]
        busy = [(e.start, e.end) for e in self.filter(rank=rank, cat=COMPUTE, step=step)
                if e.name in under]
        total = sum(e - s for s, e in comm)
        if total <= 0:
            return 0.0
        hidden = sum(max(0.0, min(ce, be) - max(cs, bs)) for cs, ce in comm for bs, be in busy)
        return min(1.0, hidden / total)

    def to_dicts(self) -> list[dict]:
        return [asdict(e) for e in self.events]

    def to_chrome(self, path: Optional[str] = None) -> dict:
        """Chrome trace-event JSON (Perfetto, chrome://tracing): one track per rank, every
        time in µs from ``t0`` (see :func:`labkit.trace_chrome.to_chrome`).

        Returns the JSON object; writes it to ``path`` when given.
        """
        from .trace_chrome import to_chrome

        return to_chrome(self, path)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        span = (max(e.end for e in self.events) - self.t0) if self.events else 0.0
        # the timeline draws the spans; a Chrome trace adds a name entry per track
        marks = sum(e.cat == MARK for e in self.events)
        return (f"Trace({len(self.events)} events: {len(self.events) - marks} spans + {marks} "
                f"marks, ranks={self.ranks}, span={span:.3f} s)")

