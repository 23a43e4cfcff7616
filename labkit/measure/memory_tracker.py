"""The memory tracker :func:`labkit.measure.memory.measure_memory` runs a step under.

A subclass of torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) that works
around the quirks listed in :mod:`labkit.measure.memory` (torch 2.13): it lets the root module
run forward again, keeps ``optimizer.step``'s temporaries out of "optimizer", skips the
per-module peak walk, tags a root's own parameters swapped in by its pre-forward hook, and
tags hand-assigned gradients. Built on demand by :func:`_make_tracker` (torch's private tools
are imported only when a step is measured).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

__all__: list[str] = []


#: what ``tensor.device`` of a fake tensor dispatches to (half the calls under fake tensors)
_DEVICE_QUERY = torch.ops.prim.device.default


def _make_tracker():
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import (_TOTAL_KEY, MemTracker, _MemRefType,
                                                      _UpdateType)
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    class _Tracker(MemTracker):
        """MemTracker allowing repeated root forwards and separating optimizer temporaries."""

        def __init__(self) -> None:
            super().__init__()
            self._opt_new: list = []        # (winfo, weakref to storage) new during step
            self._pending: Optional[dict] = None  # device -> [winfo] new & alive at the peak
            self._hooks: list = []

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]  # a new iteration of the root module
            super()._pre_fw_hook(module, inputs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _DEVICE_QUERY:  # asks a tensor subclass its device: allocates nothing
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t: torch.Tensor) -> None:
            if not self._in_opt:
                return super()._track(reftype, t)
            fresh = [st for st in get_untyped_storages(t) if st not in self._WINFO]
            super()._track(reftype, t)
            for st in fresh:
                hit = self._WINFO.get(st)
                if hit is not None:
                    self._opt_new.append((hit[0], weakref.ref(st)))

        def _update_peak_stats(self, peak_state) -> None:
            # MemTracker also walks every module it has seen, at every operator, to keep
            # per-module peaks; labkit reads only the device peak, and the walk made a
            # tracked step of a many-layer stage cost milliseconds per operator
            raised = False
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    raised = True
            if not raised:
                return
            if not self._in_opt:
                self._pending = None
                return
            alive: dict = {}
            for winfo, ref in self._opt_new:
                if ref() is not None and winfo.reftype == _MemRefType.OPT:
                    alive.setdefault(winfo.device, []).append((winfo, winfo.mem_consumed))
            self._pending = alive

        def _post_step(self, optimizer, args, kwargs) -> None:
            if self._pending:
                states = set()
                for st_dict in optimizer.state.values():
                    for val in st_dict.values():
                        if isinstance(val, torch.Tensor):
                            for st in get_untyped_storages(val):
                                hit = self._WINFO.get(st)
                                if hit is not None:
                                    states.add(id(hit[0]))
                for dev, items in self._pending.items():
                    moved = sum(mem for w, mem in items if id(w) not in states)
                    snap = self._peak_mem_snap.get(dev)
                    if snap is not None and moved:
                        snap[_MemRefType.OPT] -= moved
                        snap[_MemRefType.TEMP] += moved
            self._pending = None
            self._opt_new = []

        def _pre_step(self, optimizer, args, kwargs) -> None:
            self._opt_new = []

        def track_own_params(self, module: nn.Module, inputs: Any) -> None:
            """Tag as parameters the storages of ``module``'s own parameters, as MemTracker
            does in its pre-forward hook — which runs before the module's own hooks, so a
            parameter that the module's own pre-forward hook swaps in kept the tag of the
            buffer it lives in: FSDP2 all-gathers the parameters a root holds directly (a
            ViT's class token and position table) into storage written during forward, which
            was counted as activations (9,216 bytes a rank for the matrix's ViT on 4 ranks,
            parameters under-reported by as much). Installed last on every module."""
            for prm in module.parameters(recurse=False):
                self._update_and_maybe_create_winfos(prm, _MemRefType.PARAM)

        def tag_gradients(self, model: nn.Module) -> None:
            """Tag as gradients the tracked storages of ``model``'s ``.grad`` tensors.

            MemTracker tags a gradient when autograd accumulates it (its parameter hooks);
            a gradient assigned by hand (zero-bubble pipelines' deferred weight pass,
            ``p.grad = dYᵀX``) would otherwise stay an activation or a temporary. Storages
            made before the tracked step (DDP's bucket views) are not touched."""
            for prm in model.parameters():
                if prm.grad is None:
                    continue
                for st in get_untyped_storages(prm.grad):
                    hit = self._WINFO.get(st)
                    if hit is not None and hit[0].reftype != _MemRefType.GRAD:
                        old = hit[0].reftype
                        hit[0].reftype = _MemRefType.GRAD
                        self._update_snap(_UpdateType.REF, hit[0], old_reftype=old)

        def __enter__(self):
            out = super().__enter__()
            if self._depth == 1:  # hooks run after MemTracker's own (insertion order)
                self._hooks = [register_optimizer_step_pre_hook(self._pre_step),
                               register_optimizer_step_post_hook(self._post_step)]
            return out

        def __exit__(self, *args) -> None:
            if self._depth == 1:
                for h in self._hooks:
                    h.remove()
                self._hooks = []
            super().__exit__(*args)

    return _Tracker()
