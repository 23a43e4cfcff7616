"""Return from a collective only once the backend has let go of its tensors.

gloo runs a collective on a worker thread that holds the op's tensors (through the work
object) and drops them a moment *after* the caller's ``wait()`` returns, the woken caller
often running first. A buffer the caller then drops — the ``torch.cat`` input of a
tensor-parallel all-gather, a received pipeline gradient — is freed on that thread, at a time
set by thread scheduling. A memory tracker that snapshots at every allocation then sees the
buffer for a variable number of operators: the same step's peak varied run to run by one
such buffer (16 KiB on a tiny tensor-/pipeline-parallel rank, in about one run of six), or
moved to another phase of the step altogether.

So, inside :func:`settling` (a memory-tracked step), :class:`labkit.comm.Handle` counts the references to each tensor of its op just before
it is issued (``Tensor._use_count``: the backend's copies and views raise it) and after
``wait()`` waits until they are back to those counts. Then a buffer the caller drops is
freed at that line, on the caller's thread, in every run. Cost: one counter read per tensor,
and a pause only in the runs where the worker had not yet let go. An async caller that drops
its own last reference while the op is in flight leaves the free to the backend.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator, Sequence

import torch

__all__ = ["refs", "wait_released", "settling", "active"]

#: give up waiting for a worker thread after this long (seconds): a backend that keeps a
#: tensor for good (a cached buffer) must not stall a job
RELEASE_TIMEOUT_S = 0.05


_depth = 0


def active() -> bool:
    """Whether ops issued now wait for their release (inside :func:`settling`)."""
    return _depth > 0


@contextlib.contextmanager
def settling() -> Iterator[None]:
    """Within the block, labkit's collectives return only once the backend let go of their
    tensors. :func:`labkit.measure.measure_memory` runs its step inside it; elsewhere the
    wait would only add the worker's wake-up time to every message (on 4 ranks sharing 2
    cores it widened a pipeline's measured bubble by several points)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def refs(tensors: Sequence[torch.Tensor]) -> list:
    """References to each tensor's ``TensorImpl``, right now. A backend's copies of the
    tensor count, and so do its views (a view keeps its base); the storage's own count would
    not do: every other slice of a shared buffer (a ring's chunks) raises it."""
    return [t._use_count() for t in tensors]


def wait_released(tensors: Sequence[torch.Tensor], target: list,
                  timeout_s: float = RELEASE_TIMEOUT_S) -> bool:
    """Wait until every tensor has at most ``target``'s references (see :func:`refs`).

    Returns:
        ``True`` once released; ``False`` if ``timeout_s`` passed first (nothing raised: the
        op itself finished, only the moment of a later free is left to the backend).
    """
    deadline = None
    while True:
        now = refs(tensors)
        if all(a <= b for a, b in zip(now, target)):
            return True
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        elif time.monotonic() > deadline:
            return False
        os.sched_yield()  # the worker may be waiting for this core
        time.sleep(2e-5)
