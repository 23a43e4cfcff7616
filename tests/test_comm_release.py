"""A collective returns only once the backend has let go of its tensors
(:mod:`labkit.comm_release`), so a buffer the caller drops is freed on the caller's line.

The backend is modelled in-process: a work object that holds a view of the tensor, and a
worker thread that holds another and drops it a few milliseconds after ``wait()`` returned,
as gloo's worker does. Without the wait in :meth:`labkit.comm.Handle.wait` the tensor is still
referenced when ``wait()`` returns (the first test fails).
"""
from __future__ import annotations

import threading
import time

import torch

from labkit.comm import Handle
from labkit.comm_release import refs, wait_released


class _Work:
    """A work object like gloo's: holds the op's tensor; the worker drops its own reference
    ``delay_s`` after ``wait()``."""

    def __init__(self, t: torch.Tensor, worker: list, delay_s: float):
        self.mine, self.worker, self.delay_s = t.view(-1), worker, delay_s

    def wait(self) -> None:
        def release():
            time.sleep(self.delay_s)
            self.worker.clear()
        threading.Thread(target=release, daemon=True).start()


def test_wait_returns_after_the_worker_released_the_tensor():
    t = torch.zeros(64)
    before = refs([t])
    worker = [t.view(-1)]  # the worker thread's reference
    h = Handle(_Work(t, worker, 0.005), None, tensors=(t,), before=before)
    h.wait()
    assert worker == []
    assert refs([t]) == before


def test_a_caller_that_dropped_a_reference_in_flight_is_not_stalled():
    """The wait is for the references at issue; fewer ones now return at once (the
    backend may then free the tensor later: an async caller that drops its last reference
    before ``wait()`` hands the moment of the free to the backend)."""
    t = torch.zeros(64)
    mine = t.view(-1)  # a caller's view, dropped while the op is in flight
    before = refs([t])
    h = Handle(_Work(t, [], 0.0), None, tensors=(t,), before=before)
    del mine
    t0 = time.monotonic()
    h.wait()
    assert time.monotonic() - t0 < 0.04  # returned at once, not after the bound


def test_a_backend_that_keeps_the_tensor_does_not_stall_the_job():
    t = torch.zeros(8)
    target = refs([t])
    kept = t.view(-1)  # noqa: F841  (kept for good)
    assert wait_released([t], target, timeout_s=0.01) is False


def test_only_a_memory_tracked_step_waits_for_releases():
    """Elsewhere the wait would add the worker's wake-up time to every message."""
    from labkit import comm_release
    from labkit.measure.memory import measure_memory

    seen = []
    assert not comm_release.active()
    measure_memory(lambda: seen.append(comm_release.active()), torch.nn.Linear(2, 2), None)
    assert seen == [True] and not comm_release.active()
