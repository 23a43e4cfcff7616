"""ZeRO-3 / FSDP (and HSDP) from labkit's traced collectives.

Every rank keeps only its shard (``Ψ/K`` elements) of each unit's flat parameter, gradient
and Adam state: 16Ψ/K bytes of model state (Rajbhandari et al. 2020, §5.3, P_os+g+p).
The lecture's six steps per unit — all-gather before forward, free after; all-gather again
before backward; reduce-scatter the gradient and free it; each rank updates its shard —
are FSDP's (Zhao et al. 2023, "PyTorch FSDP", §3.2–3.3, §4.1):

* **Forward.** A forward pre-hook on the unit's module waits for (or issues) the unit's
  all-gather into ``flat`` and installs the parameter views (see :mod:`labkit.parallel.zero.flat`);
  with ``prefetch`` it then issues the *next* unit's all-gather asynchronously, so the
  transfer runs (gloo's worker thread) while this unit computes. A forward hook frees the
  unit (``flat``'s storage is resized to 0 — the saved views keep pointing at that same
  storage) and registers a tensor hook on the unit's output.
* **One order on every rank** (:mod:`labkit.parallel.dp.ordered`). Forward all-gathers go out
  in unit-list order: a unit needed early first issues those before it, and units a forward
  skipped are gathered and freed at its end. Backward is one program
  (:func:`~labkit.parallel.dp.ordered.backward_program`): root, then the blocks last to first,
  each block's reduce-scatter right after the next gather. Ranks whose orders differ by
  adjacent units get the same sequence; wider differences raise ``OrderError``.
* **Turn.** The root unit (embedding, final norm, head: it finishes forward last) stays
  gathered into backward when ``keep_last`` (as FSDP2's root), saving one all-gather.
* **Backward.** The output's tensor hook fires just before the unit's backward and
  re-gathers ``flat`` *into the same storage*, so the activations autograd saved (views of
  ``flat``) are valid again — writes go through ``flat.data``, whose own version counter
  keeps autograd's saved-tensor check quiet; with ``prefetch`` it issues the program's next
  gather. When the unit's backward is complete, ``flat``'s post-accumulate-grad hook
  reduce-scatters ``flat.grad`` (mean, async, in its turn) into the gradient shard and frees
  the parameters; ``flat.grad`` is dropped when the reduce-scatter completes. A recomputed
  unit (activation checkpointing) runs its hooks inside backward: they only re-install views.
* **HSDP.** With a replicate group (``M`` replicas of ``K`` shards) the gradient shards are
  all-reduced across replicas after the reduce-scatters: FSDP inside, DP across.

Why hooks on outputs rather than ``register_full_backward_pre_hook``: full backward hooks
wrap inputs and outputs in an extra autograd node per call and require tensor inputs; a
tensor hook is the smallest thing that runs right before the unit's backward, as in FSDP1's
``_register_pre_backward_hooks``.

Memory: parameters, gradients and Adam state are ``K``-way shards; the *working set* is
the gathered units (root + the current block + one prefetched block) and the in-flight
full gradients of at most ``max_inflight`` units; both peaks are recorded
(``max_gathered_bytes``, ``max_inflight_grad_bytes``). Each wait on an all-gather is
recorded as a ``"wait"`` trace event (issuing one too: the compute thread is not computing
then), so the fraction of all-gather time hidden under compute is
``1 − blocked / all-gather span``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ... import comm
from ...trace import COMPUTE, Event, current_tracer
from .flat import FlatUnit
from .hsdp import hsdp_groups  # re-exported
from ..dp.ordered import CollectiveProgram, backward_program
from .sharded import ShardedDataParallel

__all__ = ["FullyShardedDataParallel", "hsdp_groups"]


class FullyShardedDataParallel(ShardedDataParallel):
    """ZeRO stage 3 / FSDP over ``shard_group``; HSDP with a ``replicate_group``.

    Args:
        module: the model (units: ``module.layers`` unless ``units`` is given).
        shard_group, replicate_group: see :func:`hsdp_groups`.
        prefetch: issue the next unit's all-gather before computing the current one.
        keep_last: keep the root unit gathered across the forward→backward turn.
        mixed_precision: bf16 parameters, gradients and traffic; fp32 master shards.
        reduce_op, ignored_params, max_inflight, axis: see
            :class:`~labkit.parallel.zero.sharded.ShardedDataParallel`.

    Per step: ``forward``/``backward``, ``finish_gradient_sync()``, ``optimizer.step()``,
    ``after_step()``, ``zero_grad()`` (see :class:`ShardedDataParallel`).

    Raises:
        OrderError: (in backward) this rank's backward order is not servable in the
            canonical order (see :mod:`labkit.parallel.dp.ordered`).
        RuntimeError: a unit's forward ran outside this wrapper's forward while it was
            not gathered.
        ValueError: (in forward) a unit is part of a multi-block checkpoint segment.
    """

    def __init__(self, module: nn.Module, shard_group=None, replicate_group=None, *,
                 prefetch: bool = True, keep_last: bool = True,
                 mixed_precision: bool = False, units: Optional[Sequence[nn.Module]] = None,
                 max_inflight: int = 1, axis: str = "dp", reduce_op: str = "avg",
                 ignored_params: Iterable = ()):
        super().__init__(module, shard_group, replicate_group, stage=3,
                         mixed_precision=mixed_precision, units=units,
                         max_inflight=max_inflight, axis=axis, reduce_op=reduce_op,
                         ignored_params=ignored_params)
        self.prefetch, self.keep_last = prefetch, keep_last
        self.reduce_in_backward = True
        self.gathered_bytes = self.max_gathered_bytes = 0
        self._fw: Optional[CollectiveProgram] = None   # the forward now running
        self._fw_used: set = set()
        root = self.root
        self.gather_order = ([root] if root is not None else []) + [
            u for u in reversed(self.units) if u is not root]
        self._elem = torch.tensor([], dtype=self.param_dtype).element_size()
        for u in self.units:
            u.module.register_forward_pre_hook(self._pre_forward_hook(u))
            u.module.register_forward_hook(self._post_forward_hook(u))

    @property
    def root(self) -> Optional[FlatUnit]:
        return self.units[0] if len(self.units) and self.units[0].name == "root" else None

    def gathered_buffers(self) -> list:
        """The flat buffers that hold gathered parameters (pass to ``measure_memory``'s
        ``track`` so their bytes count as "other", the working set)."""
        return [u.flat for u in self.units]

    def forward(self, *args, **kwargs):
        self._tracer = current_tracer()
        self._refuse_segments()
        self._drain()
        self._fw = CollectiveProgram([("ag", u) for u in self.units], self._issue,
                                     pull=[("ag", u) for u in self.units])
        self._fw_used = set()
        try:
            out = self.module(*args, **kwargs)
            self._fw.flush()  # units this forward skipped: another rank's may have used them
        finally:
            self._fw = None
        for u in self.units:
            if u not in self._fw_used:
                self._reshard(u)
        return out

    def _refuse_segments(self) -> None:
        """A multi-block checkpoint segment runs its later blocks inside the first one's
        forward, where their hooks never fire: they would compute ungathered."""
        for u in self.units:
            policy = u.module.__dict__.get("checkpoint_policy")
            if policy and policy[1] > 1:
                raise ValueError(
                    f"FSDP unit {u.name!r} is part of a {policy[1]}-block checkpoint segment "
                    f"(policy {policy[0]!r}); use policy 'full' or 'selective' with ZeRO-3, "
                    f"or make each segment one unit (units=...)")

    def finish_gradient_sync(self) -> None:
        super().finish_gradient_sync()
        for u in self.units:  # anything left gathered (e.g. a prefetch never used)
            self._reshard(u)
            u.bw_started = False

    def after_step(self) -> None:
        """After ``optimizer.step()``: mixed precision copies the fp32 master shards into
        the bf16 shards that the next all-gathers send (fp32: the shard is the master)."""
        if self.mixed_precision:
            with torch.no_grad():
                for u in self.units:
                    u.shard.copy_(u.master)

    # -- the canonical order ---------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only gather: each unit's full gradient accumulates in
        ``flat.grad`` (memory: the unsharded gradient, as FSDP2's
        ``set_requires_gradient_sync(False)``) until a synced backward or
        ``finish_gradient_sync`` reduce-scatters it. (``require_sync``, which the ZeRO jobs
        set per microbatch, is ignored at stage 3, as at stage 2.)"""
        old, self.reduce_in_backward = self.reduce_in_backward, False
        try:
            yield
        finally:
            self.reduce_in_backward = old

    def _syncs(self) -> bool:
        return self.reduce_in_backward

    def _round_ops(self) -> list:
        if not self._syncs():
            return [("ag", u) for u in self.gather_order]
        return backward_program(self.gather_order, self.reduce_order)

    def _round_pulls(self) -> list:
        return [("ag", u) for u in self.units]

    def _issue(self, op) -> None:
        kind, u = op
        if kind == "rs":
            self._reduce_scatter(u)
        else:
            self._gather(u, "forward" if self._fw is not None else "backward")

    def _end_round(self) -> None:
        super()._end_round()  # units the backward never needed were gathered: free them
        for u in self.units:
            self._reshard(u)
            u.bw_started = False

    # -- the six steps -------------------------------------------------------------------
    def _pre_forward_hook(self, u: FlatUnit):
        def hook(module, args):
            if self._fw is None:  # recomputation inside backward, or a stray call
                if not (u.gathered or u.handle is not None):
                    raise RuntimeError(
                        f"FSDP unit {u.name!r} ran outside the wrapper's forward while its "
                        f"parameters were sharded; call the wrapper, not the inner module")
                self._wait(u, "recompute")
                u.install_views()
                return
            self._fw_used.add(u)
            self._fw.pull(("ag", u))
            self._wait(u, "forward")
            u.install_views()
            if self.prefetch:
                self._fw.prefetch_after(("ag", u))
            u.t_compute = _now()
        return hook

    def _post_forward_hook(self, u: FlatUnit):
        def hook(module, args, output):
            if self._fw is None:
                return  # recomputation: the unit stays gathered for its backward
            _span(f"{u.name}.forward", u.t_compute, u.name)
            grad = torch.is_grad_enabled()
            if not (grad and self.keep_last and u is self.root):
                self._reshard(u)
            if grad:
                u.bw_started = False
                for t in tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward_hook(u))
        return hook

    def _pre_backward_hook(self, u: FlatUnit):
        def hook(grad):
            return self._traced(self._pre_backward, u)
        return hook

    def _pre_backward(self, u: FlatUnit) -> None:
        if u.bw_started:
            return
        u.bw_started = True
        program = self._begin_round()
        program.pull(("ag", u))
        self._wait(u, "backward")
        if self.prefetch:
            program.prefetch_after(("ag", u))
        u.t_compute = _now()

    def _post_backward(self, u: FlatUnit) -> None:
        _span(f"{u.name}.backward", u.t_compute, u.name)
        program = self._begin_round()
        if ("rs", u) in program:
            program.mark_ready(("rs", u))
        self._reshard(u)
        u.bw_started = False

    # -- gather / free ---------------------------------------------------------------------
    def _gather(self, u: FlatUnit, phase: str) -> None:
        if u.gathered or u.handle is not None:
            return  # the root kept from forward (keep_last): the same on every rank
        t0 = _now()
        u.flat.untyped_storage().resize_(u.padded * self._elem)
        u.handle = comm.all_gather(u.flat.data, u.shard.detach(), group=self.shard_group,
                                   axis=self.axis, async_op=True, unit=u.name, phase=phase,
                                   mesh_dim="shard")
        _blocked("issue", t0, u.name, phase, self.axis)
        self.gathered_bytes += u.padded * self._elem
        self.max_gathered_bytes = max(self.max_gathered_bytes, self.gathered_bytes)

    def _wait(self, u: FlatUnit, phase: str) -> None:
        if u.handle is None:
            return
        t0 = _now()
        u.handle.wait()
        u.handle, u.gathered = None, True
        _blocked("wait", t0, u.name, phase, self.axis)

    def _reshard(self, u: FlatUnit) -> None:
        if u.handle is not None:
            self._wait(u, "reshard")
        if u.gathered:
            u.flat.untyped_storage().resize_(0)
            u.gathered = False
            self.gathered_bytes -= u.padded * self._elem


def _now() -> float:
    tracer = current_tracer()
    return tracer.now() if tracer is not None else 0.0


def _blocked(what: str, start: float, unit: str, phase: str, axis: str) -> None:
    """Record time the compute thread was blocked on an all-gather (issuing or waiting),
    on the gather's mesh ``axis``: an overlap figure pairs the blocked time with the calls
    of its own axis (:func:`labkit.train.metrics.overlap_fraction`)."""
    tracer = current_tracer()
    if tracer is not None:
        tracer.record(Event(tracer.rank, f"{what} all_gather", "wait", start, tracer.now(),
                            axis=axis, args={"unit": unit, "phase": phase}))


def _span(name: str, start: float, unit: str) -> None:
    tracer = current_tracer()
    if tracer is not None and start:
        tracer.record(Event(tracer.rank, name, COMPUTE, start, tracer.now(),
                            args={"unit": unit}))
