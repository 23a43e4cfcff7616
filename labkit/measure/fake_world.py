"""One rank of a cluster-scale world inside this process, for
:mod:`labkit.measure.fake_rank` and :func:`labkit.measure.layer_activations.fake_layer_activations`.

* :func:`fake_process_group`: torch's ``"fake"`` backend with ``FakeStore`` (from
  ``torch.testing._internal.distributed.fake_pg``) for the layout's world size, and the
  rank's :class:`~labkit.worker.RankContext`, its groups made on demand (:func:`_context`);
* :func:`_fake_mode`: torch's ``FakeTensorMode``, answering data-dependent scalar reads;
* :func:`_p2p_holds_tensors`: a non-blocking send keeps its tensor until waited for, as gloo
  and NCCL do.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

__all__ = ["fake_process_group", "check_fake_rank"]


_SCALAR = torch.ops.aten._local_scalar_dense.default
_DEVICE = torch.ops.prim.device.default
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


def _fake_mode():
    """torch's ``FakeTensorMode`` that also answers every data-dependent scalar read
    (``.item()``, ``bool(t)``) with 1 or False (fake tensors hold no values), and a fake
    tensor's device query (asked from C++ at every autograd step) before its dispatch
    machinery: one Python mode per operator instead of two.

    ``aten._unsafe_view`` (a linear layer's 3-D output) is answered as ``aten.view``:
    torch runs the same fake kernel for both (the input's storage, reshaped), but bypasses
    its fake-tensor cache for ``_unsafe_view``, which then cost ~3x a cached operator."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class _FakeWithScalars(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _DEVICE:
                dev = getattr(args[0], "fake_device", None)
                if dev is not None:
                    return dev
            elif func is _SCALAR:
                t = args[0]
                if t.dtype == torch.bool:
                    return False
                return 1.0 if t.is_floating_point() else 1
            elif func is _UNSAFE_VIEW:
                func = _VIEW
            return super().__torch_dispatch__(func, types, args, kwargs or {})

    return _FakeWithScalars(allow_non_fake_inputs=True)


class _HeldWork:
    """A point-to-point work that keeps its tensor alive until ``wait()``, as gloo's and
    NCCL's works do (a sent activation is freed only after its send completes); the fake
    backend's works keep nothing, which would free it early. ``on_wait(tensor)`` runs when
    a receive is waited for."""

    def __init__(self, work, tensor, on_wait=None):
        self._work, self._tensor, self._on_wait = work, tensor, on_wait

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs) if self._work is not None else True
        if self._on_wait is not None and self._tensor is not None:
            self._on_wait(self._tensor)
        self._tensor = None
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _p2p_holds_tensors(ledger=None):
    saved = {name: getattr(dist, name) for name in ("isend", "irecv")}

    def holding(fn, receive):
        def call(tensor, *args, **kwargs):
            on_wait, tag = None, kwargs.get("tag", args[2] if len(args) > 2 else 0)
            if ledger is not None and receive:
                on_wait = lambda t, tag=tag: ledger.on_wait(t, tag)  # noqa: E731
            elif ledger is not None:
                ledger.on_send(tag)
            return _HeldWork(fn(tensor, *args, **kwargs), tensor, on_wait)
        return call

    try:
        for name, fn in saved.items():
            setattr(dist, name, holding(fn, name == "irecv"))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _context(rank: int, world: int, stage_layers_only: bool = True):
    """A :class:`labkit.worker.RankContext` whose mesh groups are made on demand: the
    pool-wide list (``Mesh.required_groups``) of a cluster-scale mesh has hundreds of
    thousands of entries and is only needed when real processes must agree on it. With
    ``stage_layers_only`` the job builds only the layers this rank's stages keep
    (:mod:`labkit.train.build`)."""
    from labkit.mesh import MeshGroups, ProcessGroups
    from labkit.trace import Tracer
    from labkit.worker import RankContext

    class _OnDemand(ProcessGroups):
        """Only this rank's groups, made when first asked for: under the fake backend
        ``new_group`` needs no other process, and the world's every group (thousands at
        cluster scale) is never needed by one rank."""

        def ensure(self, tuples) -> None:
            pass

        def get(self, ranks):
            key = tuple(sorted(ranks))
            if key not in self._groups:
                self._groups[key] = self._dist.new_group(list(key))
                self.created += 1
            return self._groups[key]

    class _FakeContext(RankContext):
        def mesh_groups(self, mesh):
            return MeshGroups(mesh, self.rank, self.groups)

    ctx = _FakeContext(rank, world, torch.device("cpu"), dist.group.WORLD, "fake",
                       Tracer(rank), {}, _OnDemand())
    ctx.stage_layers_only = stage_layers_only
    return ctx


def check_fake_rank(cfg, rank) -> int:
    """The world size of ``cfg``, once ``rank`` is one of its ranks and this process can
    hold a fake process group.

    Raises:
        ValueError: ``rank`` outside ``0 .. world_size - 1``.
        RuntimeError: ``torch.distributed`` is already initialised in this process.
    """
    world = cfg.parallel.world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1} (world_size {world}), got {rank!r}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; the "
                           "fake process group needs a process of its own")
    return world


@contextlib.contextmanager
def fake_process_group(cfg, rank: int, stage_layers_only: bool = True):
    """Rank ``rank`` of ``cfg``'s world in this process: torch's ``"fake"`` backend with
    ``FakeStore`` initialised for the layout's world size, and the rank's
    :class:`~labkit.worker.RankContext` (groups made on demand, :func:`_context`) yielded;
    the group is destroyed on exit. Enter fake tensors (:func:`_fake_mode`) inside it: the
    text corpus is read here first, for real (it is cached per process).

    Raises what :func:`check_fake_rank` raises.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = check_fake_rank(cfg, rank)
    if cfg.dataset == "text":
        from labkit.models.data import text_corpus

        text_corpus("train")  # cached per process: read it for real, not as a fake tensor
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ctx = _context(rank, world, stage_layers_only)
        with warnings.catch_warnings():
            # the data-parallel wrappers' and the pipeline's activation meter key storages
            # by data_ptr, which fake tensors do not have (their counts are not used here)
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            yield ctx
    finally:
        dist.destroy_process_group()
