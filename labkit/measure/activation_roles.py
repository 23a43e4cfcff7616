"""The activations one measured step held, itemised by what each tensor is for.

The job's memory tracker (:func:`labkit.measure.measure_memory`, torch's ``MemTracker``)
counts as *activations* every storage created in forward and in the recomputation of a
checkpointed layer. :class:`RoleLedger` watches the same storages, classifies each when it
is created and keeps live bytes per role, so that at the activations' peak (and at the
moment of the highest total) it can say which tensors made it up:

========================  ================================================================
``kept layers``           each block's output (the next block's input), the embedding's
                          output, and a received activation once in use (the stage's input)
``stage outputs``         the output of the stage's last block, on every stage but the
                          last: kept by the pipeline executor until its flush ends
``layer working set``     anything else a block creates in forward: with full recomputation
                          the temporaries of the layer running; without, what it saves
``rebuilt layer``         created during backward by the recomputation of a checkpointed
                          layer
``receive buffers``       the pipeline executor's receive buffers: posted ahead of need, or
                          a received gradient in use
``rotary tables``         the cos/sin rows indexed per forward (``rope_slice``)
``tracker-held inputs``   a received stage input whose backward is over: torch's tracker
                          hooks the gradient of every module input and keeps the input until
                          the step ends (an artifact of measuring, alike in a real run)
``other``                 everything else (the batch, token ids, the loss on the last stage,
                          autocast's copies of fp32 weights)
========================  ================================================================

Blocks are recognised by the tracker's module names (``…layers.{k}``); a block's output is
re-filed when the block's forward returns it. The pipeline executor's receives are told
apart by their message tags (:func:`~labkit.parallel.pipeline.executor.message_tag`: odd for
activations, even for gradients): an activation moves to ``kept layers`` when waited for,
and to ``tracker-held inputs`` when the stage sends that microbatch's input gradient. Used
by :func:`labkit.measure.fake_rank.fake_rank_memory` (one process: it patches the tracker
factory for the duration of one run).
"""
from __future__ import annotations

import contextlib
import re
import weakref
from collections import Counter
from typing import Optional

import torch

__all__ = ["ROLES", "RoleLedger", "itemised_tracker"]

ROLES = ("kept layers", "stage outputs", "layer working set", "rebuilt layer", "receive buffers",
         "rotary tables", "tracker-held inputs", "other")
_BLOCK = re.compile(r"layers\.(\d+)(\..*)?$")
_INDEX = torch.ops.aten.index.Tensor


class RoleLedger:
    """Live activation bytes by role, with snapshots at the activations' own peak
    (:attr:`at_peak`, :attr:`peak`) and at each new peak of the tracked total
    (:attr:`at_total_peak`). Block outputs are kept as ``("block", k)`` until
    :meth:`resolve` knows which block is a stage's last.

    Args:
        boundary: shape of the tensor crossing a pipeline stage boundary ``(b, S', H)``.
        rotary_width: ``head_dim // 2``, the width of a rotary table.
    """

    def __init__(self, boundary: tuple, rotary_width: int):
        self.boundary, self.rotary_width = tuple(boundary), rotary_width
        self.live: Counter = Counter()
        self._where: dict = {}   # id(storage) -> [role, bytes]
        self._refs: set = set()
        self._inputs: dict = {}  # activation tag -> weakref to its storage
        self.bytes = self.peak = 0
        self.at_peak: dict = {}
        self.at_total_peak: dict = {}

    # ------------------------------------------------------------------ bookkeeping
    def add(self, storage, role, nbytes: int) -> None:
        key = id(storage)
        self._where[key] = [role, nbytes]
        self.live[role] += nbytes
        self.bytes += nbytes

        def freed(ref, key=key):
            self._refs.discard(ref)
            entry = self._where.pop(key, None)
            if entry is not None:
                self.live[entry[0]] -= entry[1]
                self.bytes -= entry[1]

        self._refs.add(weakref.ref(storage, freed))
        if self.bytes > self.peak:
            self.peak = self.bytes
            self.at_peak = +self.live

    def move(self, tensor: torch.Tensor, role) -> None:
        """Re-file ``tensor``'s storage under ``role`` (if it is an activation)."""
        entry = self._where.get(id(tensor.untyped_storage()))
        if entry is not None and entry[0] != role:
            self.live[entry[0]] -= entry[1]
            self.live[role] += entry[1]
            entry[0] = role

    def total_peak(self) -> None:
        self.at_total_peak = +self.live

    # ------------------------------------------------------------------ classification
    def role(self, func, t: torch.Tensor, parents, in_backward: bool, arg=None):
        """The role of a storage ``t`` just created by ``func`` (first argument ``arg``)."""
        if in_backward:
            return "rebuilt layer"
        if isinstance(arg, torch.nn.Parameter):
            return "other"  # autocast's cached low-precision copy of a weight
        if func is _INDEX and t.dtype == torch.float32 and t.dim() == 2 \
                and t.shape[1] == self.rotary_width:
            return "rotary tables"
        inner = max(parents, key=len) if parents else "Global"
        if _BLOCK.search(inner) is not None:
            return "layer working set"  # a block's output is re-filed by on_output
        if inner == "Global" and tuple(t.shape) == self.boundary:
            return "receive buffers"  # the executor's; see on_wait
        return "other"

    def on_output(self, name: str, out) -> None:
        """A module finished its forward: a block's output is ``("block", k)``, the
        embedding's is a kept layer input."""
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != self.boundary:
            return
        m = _BLOCK.search(name)
        if m is not None and m.group(2) is None:
            self.move(out, ("block", int(m.group(1))))
        elif name.endswith("tok_emb"):
            self.move(out, "kept layers")

    def on_wait(self, tensor: torch.Tensor, tag: int) -> None:
        """A receive completed: an activation (odd tag) is now a stage input."""
        entry = self._where.get(id(tensor.untyped_storage()))
        if tag % 2 == 1 and entry is not None and entry[0] == "receive buffers":
            self.move(tensor, "kept layers")
            self._inputs[tag] = weakref.ref(tensor.untyped_storage())

    def on_send(self, tag: int) -> None:
        """A stage sent a gradient (even tag): that microbatch's backward on this stage is
        over, so its received input (tag ``- 3``: :func:`~labkit.parallel.pipeline.executor.
        message_tag`) is no longer the pipeline's; if still alive, the tracker holds it."""
        ref = self._inputs.pop(tag - 3, None) if tag % 2 == 0 else None
        st = ref() if ref is not None else None
        entry = self._where.get(id(st)) if st is not None else None
        if entry is not None and entry[0] == "kept layers":
            self.live[entry[0]] -= entry[1]
            self.live["tracker-held inputs"] += entry[1]
            entry[0] = "tracker-held inputs"

    @staticmethod
    def resolve(snapshot: dict, stage_outputs: set) -> dict:
        """``{role: bytes}`` over :data:`ROLES`: block ``k``'s outputs are ``stage
        outputs`` when ``k`` is in ``stage_outputs`` (the last block of a stage that is not
        the model's last), else ``kept layers``."""
        out = dict.fromkeys(ROLES, 0)
        for role, n in snapshot.items():
            if isinstance(role, tuple):
                role = "stage outputs" if role[1] in stage_outputs else "kept layers"
            out[role] += int(n)
        return out


@contextlib.contextmanager
def itemised_tracker(ledger: RoleLedger):
    """Within the block, :func:`labkit.measure.measure_memory` builds trackers that also
    file every activation storage in ``ledger`` (one process at a time: it replaces the
    module's tracker factory and puts it back)."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _MemRefType

    from . import memory

    make = memory._make_tracker

    def make_itemised():
        base = make()
        cls = type(base)

        class _Itemised(cls):
            _func = _arg = None

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self._func, self._arg = func, args[0] if args else None
                try:
                    return super().__torch_dispatch__(func, types, args, kwargs)
                finally:  # never keep a tensor alive past its operator
                    self._func = self._arg = None

            def _track(self, reftype, t: torch.Tensor) -> None:
                if reftype != _MemRefType.ACT:
                    return super()._track(reftype, t)
                fresh = [st for st in get_untyped_storages(t) if st not in self._WINFO]
                super()._track(reftype, t)
                if not fresh:
                    return
                role = ledger.role(self._func, t, self._mod_tracker.parents,
                                   self._mod_tracker.is_bw, self._arg)
                for st in fresh:
                    if st.nbytes():
                        ledger.add(st, role, st.nbytes())

            def _post_fw_hook(self, module, inputs, outputs) -> None:
                super()._post_fw_hook(module, inputs, outputs)
                if not self._mod_tracker.is_bw:
                    ledger.on_output(self._mod_tracker.get_known_fqn(module) or "", outputs)

            def _update_peak_stats(self, peak_state) -> None:
                before = dict(self._peak_mem)
                super()._update_peak_stats(peak_state)
                if self._peak_mem != before:
                    ledger.total_peak()

        base.__class__ = _Itemised
        return base

    memory._make_tracker = make_itemised
    try:
        yield ledger
    finally:
        memory._make_tracker = make


def stage_output_blocks(n_layers: int, n_stages: int, stages, counts: Optional[list] = None
                        ) -> set:
    """Local indices of the last block of each of ``stages`` that is not the model's last
    stage (their outputs cross to the next stage)."""
    from labkit.parallel.pipeline.split import stage_layer_counts

    c = stage_layer_counts(n_layers, n_stages, counts)
    return {c[s] - 1 for s in stages if s < n_stages - 1}
