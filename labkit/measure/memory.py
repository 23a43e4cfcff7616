"""Memory by category for one training step, from torch's own ``MemTracker`` (claim C10).

``torch.distributed._tools.mem_tracker.MemTracker`` is a ``TorchDispatchMode`` that sees every
tensor storage created inside it and tags it as a parameter, buffer, gradient, activation,
temporary or optimizer state. :func:`measure_memory` wraps it and reports five categories,
in bytes (element count × element size; on CUDA MemTracker rounds each storage up to the
caching allocator's 512-byte block):

====================  =========================================================
``"parameters"``      ``PARAM``: the model's weights
``"gradients"``       ``GRAD``: ``.grad`` tensors
``"optimizer"``       ``OPT``: tensors in ``optimizer.state`` (Adam: ``m``, ``v`` and a
                      4-byte fp32 ``step`` counter per parameter tensor, which lives on the
                      CPU unless the optimizer is ``capturable``/``fused``)
``"activations"``     ``ACT``: everything created in forward (saved activations, outputs)
``"other"``           ``BUFFER`` + ``TEMP`` (created during backward) + ``OTH`` (external
                      tensors) + temporaries of ``optimizer.step``
====================  =========================================================

On CUDA Adam's step counters stay on the CPU, so the CUDA report's "optimizer" is exactly
8Ψ for fp32 Adam (seen on an H200, torch 2.11), and ``allocator_peak`` is well above the
tracked total (cuBLAS workspace and caching-allocator blocks the tracker cannot see).

For a fp32 model with Adam this gives the 4Ψ / 4Ψ / 8Ψ split of the ZeRO paper's
accounting (Rajbhandari et al. 2020, §3.1); mixed precision would give 2Ψ / 2Ψ / 12Ψ.

MemTracker quirks this module works around (torch 2.13):

* It refuses a second forward of the root module (``NotImplementedError: ... multiple
  iterative calls``), i.e. gradient accumulation or two steps. The tracker here forgets the
  root module's per-module stats instead (labkit does not use them).
* It tags **every** tensor allocated inside ``optimizer.step`` as optimizer state, so the
  peak (usually inside the first step) counted Adam's per-parameter temporaries (e.g. the
  ``sqrt(v)+eps`` denominator) as optimizer memory. The tracker here remembers which storages
  were new at the peak and, after the step, moves those that did not end up in
  ``optimizer.state`` to ``"other"``.
* Only tensors created inside the context or registered with ``track_external`` are seen;
  inputs made before the step are invisible unless passed in ``track``.
"""
from __future__ import annotations

import gc
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from labkit import comm_release
# the tracker lives in its own module; measure_memory looks it up here, so it can be swapped
from labkit.measure.memory_tracker import _DEVICE_QUERY, _make_tracker  # noqa: F401

__all__ = ["MemoryReport", "measure_memory", "CATEGORIES"]

#: Report keys in display order.
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")
_MAP = {"PARAM": "parameters", "GRAD": "gradients", "OPT": "optimizer", "ACT": "activations"}


@dataclass
class MemoryReport:
    """Memory of one measured step, bytes.

    Attributes:
        peak: bytes by category at the moment of the highest tracked total; keys exactly
            :data:`CATEGORIES`; they sum to ``peak_total``.
        peak_total: the highest tracked total (bytes).
        timeline: ``(label, bytes by category)`` snapshots: ``"start"``, each ``mark(label)``
            the step made, ``"end"``.
        allocator_peak: ``torch.cuda.max_memory_allocated`` during the step on CUDA (bytes;
            includes workspace the tracker cannot attribute); ``None`` on CPU.
        device: the device reported on.
    """

    peak: dict[str, int]
    peak_total: int
    timeline: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    allocator_peak: Optional[int] = None
    device: str = "cpu"

    def fractions(self) -> dict[str, float]:
        """Share of ``peak_total`` per category (0 when nothing was tracked)."""
        return {k: (v / self.peak_total if self.peak_total else 0.0) for k, v in self.peak.items()}


def _categorize(dev_snap: Optional[dict]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for key, val in (dev_snap or {}).items():
        name = getattr(key, "name", None)
        if name is None:  # the "Total" key
            continue
        out[_MAP.get(name, "other")] += int(val)
    return out


def _wants_mark(fn: Callable) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            return True
    return False


def _settled(read: Callable[[], dict], pause_s: float = 1e-3, tries: int = 20) -> dict:
    """``read()`` once two reads a pause apart agree (at most ``tries`` pauses).

    A gloo collective's worker thread drops its reference to the tensors of a finished
    operation just after the caller's ``wait()`` returns (the woken caller often runs
    first). A temporary the caller already let go of (a contiguous copy, a received buffer)
    is then freed on that thread a moment later, so a snapshot taken right after a
    collective sometimes counted it (2,048 bytes at a tensor-parallel forward's end, about
    one run in four). Pausing yields the core and the GIL, so the release lands; a worker
    kept off the cores longer than the pauses can still be missed. An operation still in
    flight keeps its tensors, so nothing else moves."""
    snap = read()
    for _ in range(tries):
        time.sleep(pause_s)
        again = read()
        if again == snap:
            return snap
        snap = again
    return snap


def measure_memory(step_fn: Callable[..., Any], model: nn.Module,
                   optimizer: Optional[torch.optim.Optimizer],
                   device: Union[torch.device, str] = "cpu", *,
                   track: Iterable[torch.Tensor] = (),
                   hook: Optional[Callable[[str, dict[str, int]], None]] = None
                   ) -> MemoryReport:
    """Run ``step_fn`` once under a memory tracker and report bytes by category.

    ``step_fn`` is called as ``step_fn(mark)`` if it takes a positional argument, else as
    ``step_fn()``. ``mark(label)`` records the current bytes by category in the timeline
    (e.g. ``mark("forward")`` after the forward) and passes them to ``hook(label, bytes)``
    if given (for a live widget).

    Args:
        step_fn: one training step: forward, backward, ``optimizer.step()`` (and zero_grad).
        model: its parameters, buffers and existing gradients are tracked from the start.
        optimizer: its existing state is tracked; state created during the step is tagged by
            MemTracker's optimizer hooks. ``None`` for a step without one.
        device: the device whose bytes are reported (other devices are ignored: Adam's step
            counters sit on the CPU when the model is on CUDA).
        track: extra tensors made before the step (e.g. the batch); they count as "other".
        hook: called with ``(label, bytes by category)`` at every snapshot.

    Returns:
        :class:`MemoryReport`.

    The step runs inside :func:`labkit.comm_release.settling`: labkit's collectives return
    once the backend has let go of their tensors, so a buffer is freed at the same operator
    in every run.

    Inside a traced job the step is flagged ``instrumented="memory"``
    (:func:`labkit.trace.flag_step`), so timelines mark it.

    Raises:
        Whatever ``step_fn`` raises (the tracker and its hooks are removed first).
    """
    from labkit.trace import flag_step

    flag_step("memory")  # this step runs several times slower under the tracker: say so
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    mt = _make_tracker()
    mt.track_external(model, *( [optimizer] if optimizer is not None else []), *list(track))
    timeline: list[tuple[str, dict[str, int]]] = []

    def mark(label: str) -> dict[str, int]:
        mt.tag_gradients(model)
        snap = _settled(lambda: _categorize(mt.get_tracker_snapshot("current").get(dev)))
        timeline.append((str(label), snap))
        if hook is not None:
            hook(str(label), snap)
        return snap

    allocator_peak = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    # Python's cyclic collector frees garbage (autograd graphs, frames caught in cycles) at
    # moments set by every allocation in the process, helper threads' too: left running, it
    # would free a tensor before one snapshot in one run and after it in the next. The step
    # runs with it paused, so the same step measures the same bytes. The young generations
    # are collected first (the previous step's graphs: a CUDA allocator peak would count
    # them), not the whole heap (a full walk costs a warm rank tens of milliseconds).
    gc.collect(1)
    was_enabled = gc.isenabled()
    gc.disable()
    own = [m.register_forward_pre_hook(mt.track_own_params) for m in model.modules()]
    try:
        with mt, comm_release.settling(), warnings.catch_warnings():
            # MemTracker asks for the storages of every gradient a module's backward hook
            # sees; a stage input that needs none hands it None (zero-bubble schedules'
            # first stage), which it skips with this warning: nothing goes uncounted
            warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper")
            mark("start")
            if _wants_mark(step_fn):
                step_fn(mark)
            else:
                step_fn()
            mark("end")
    finally:
        for h in own:
            h.remove()
        if was_enabled:
            gc.enable()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        allocator_peak = int(torch.cuda.max_memory_allocated(dev))
    peak = _categorize(mt.get_tracker_snapshot("peak").get(dev))
    return MemoryReport(peak=peak, peak_total=sum(peak.values()), timeline=timeline,
                        allocator_peak=allocator_peak, device=str(dev))
