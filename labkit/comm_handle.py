"""An in-flight communication op: :class:`Handle` (what :mod:`labkit.comm` returns)."""
from __future__ import annotations

import time
import weakref
from typing import Optional, Sequence

import torch

from .comm_release import wait_released
from .faults import recorder as _recorder
from .trace import Event, current_tracer

__all__ = ["Handle"]


class Handle:
    """An in-flight async op. ``wait()`` completes it and closes its trace event.

    The recorded span runs from issue to the return of ``wait()``: on gloo the work
    progresses on a background thread in between, which is the overlap a timeline shows.
    Issued inside :func:`labkit.comm_release.settling` (a memory-tracked step), ``wait()``
    returns once the backend has let go of the op's ``tensors``, so a buffer the caller
    drops afterwards is freed there.
    ``before`` is :func:`~labkit.comm_release.refs` of ``tensors`` just before the op was
    issued: ``wait()`` waits until the references are back to those (a caller that makes
    new views of an in-flight tensor before ``wait()`` waits the bound, so do it after).
    The handle holds the tensors weakly: one the caller drops in flight is freed by the
    backend, whenever it lets go (the handle's work object keeps it until ``wait()``).
    """

    def __init__(self, work, event: Optional[Event], finish=None,
                 tensors: Sequence[torch.Tensor] = (), before: Optional[list] = None,
                 recorded: Optional[int] = None):
        self._work, self._event, self._finish, self._done = work, event, finish, False
        self._recorded = recorded  # this op's slot in the rank's flight record
        self._tracer = current_tracer()  # wait() may run on another thread (a future callback)
        # weak: a tensor the caller drops in flight is the backend's to free, as before
        self._tensors: tuple = ()
        if work is not None and tensors and before is not None:
            self._tensors = tuple(zip((weakref.ref(t) for t in tensors), before))

    def note_done(self) -> None:
        """For an op left in flight: record in its event's ``args`` when the backend
        finished it (``"done"``, seconds on the tracer's clock, from a future callback on
        the backend's thread, through :meth:`labkit.trace.Tracer.stamp`) and, in
        :meth:`wait`, when the caller started waiting (``"waited"``). A timeline can then
        tell the transfer from the time the op sat finished, and from the caller's block
        (``end − waited``). gloo gives no future for send/recv: those get ``"waited"`` only."""
        event, tracer = self._event, self._tracer
        if event is None or tracer is None or self._work is None:
            return
        event.args["async"] = True

        def done(_fut, event=event, stamp=tracer.stamp):
            # the backend's thread: kept aside, never written into the event from here
            # (it may be recorded already, and being pickled; see Tracer.stamp)
            stamp(event, "done")
        try:
            self._work.get_future().add_done_callback(done)
        except RuntimeError:  # "Work::getFuture not implemented" (gloo's send/recv)
            pass

    @property
    def work(self):
        """The underlying ``torch.distributed`` work object (for ``get_future()``)."""
        return self._work

    @torch.compiler.disable
    def wait(self) -> None:
        if self._done:
            return
        if self._event is not None and self._event.args.get("async"):
            self._event.args["waited"] = self._tracer.now() if self._tracer else None
        if self._work is not None:
            self._work.wait()
            if self._tensors:
                self._work = None  # ours is one of the references to the tensors
                alive = [(t, n) for t, n in ((r(), n) for r, n in self._tensors)
                         if t is not None]
                wait_released([t for t, _ in alive], [n for _, n in alive])
                self._tensors = ()
        self.complete()

    def complete(self) -> None:
        """Close the trace event without waiting: for a future callback, which runs after
        the work finished and must not block on it."""
        if self._done:
            return
        if self._finish is not None:
            self._finish()
        self._done, self._tensors = True, ()
        if self._recorded is not None and _recorder._ACTIVE is not None:
            _recorder._ACTIVE.exit(self._recorded, time.perf_counter())
        tracer = self._tracer
        if self._event is not None and tracer is not None:
            self._event.end = tracer.now()
            tracer.record(self._event)
