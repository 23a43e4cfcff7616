"""The rank process: join the process group once, then run jobs until told to stop.

A rank is a fresh interpreter started with the *spawn* method. It

1. watches its parent and exits if the parent dies (a killed Jupyter kernel leaves no
   orphans),
2. calls ``init_process_group`` once, over a ``FileStore`` in a private temp folder, so no
   rendezvous port is opened at all; gloo's own pair sockets bind to the loopback
   interface (``GLOO_SOCKET_IFNAME=lo``), or, on an emulated node, to the node's
   ``eth0`` in its private network namespace (:mod:`labkit.nodes`),
3. answers ``("run", …)`` messages on its pipe by importing the job by module and name,
   calling ``job(ctx, config)`` under a fresh :class:`~labkit.trace.Tracer`, and sending
   back the plain-data result, the events, or the traceback.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

# resolving a job by name has its own module; the names stay importable from here
from .job_ref import _LOADED, check_config, job_reference, resolve_job  # noqa: F401

__all__ = ["RankContext", "worker_main", "resolve_job", "job_reference", "check_config",
           "context_from_env", "release_memory", "job_hooks_removed", "required_groups",
           "recorder_path"]


@dataclass
class RankContext:
    """What a job sees on its rank.

    Attributes:
        rank: this rank within the job (0 … world_size−1).
        world_size: ranks the job runs on (may be fewer than the cluster's).
        device: ``torch.device`` every tensor of the job is created on.
        group: process group spanning the job's ranks (pass it explicitly to labkit.comm).
        backend: ``"gloo"`` or ``"nccl"``.
        tracer: this rank's :class:`~labkit.trace.Tracer`.
        cache: per-process dict that survives between jobs on a warm cluster
            (calibrations, FLOP counts); never results.
        groups: the pool's :class:`~labkit.mesh.ProcessGroups`: every group of the job's
            mesh was created on every rank before the job started.
    """

    rank: int
    world_size: int
    device: Any
    group: Any
    backend: str
    tracer: Any
    cache: dict = field(default_factory=dict)
    groups: Any = None

    @property
    def is_cuda(self) -> bool:
        return getattr(self.device, "type", "cpu") == "cuda"

    def mesh_groups(self, mesh):
        """This rank's :class:`~labkit.mesh.MeshGroups` of ``mesh`` (groups created on demand
        when every rank runs the job, as under torchrun)."""
        from .mesh import MeshGroups, ProcessGroups

        if self.groups is None:
            self.groups = ProcessGroups()
        self.groups.ensure(required_groups(mesh))
        return MeshGroups(mesh, self.rank, self.groups)


@functools.lru_cache(maxsize=8)
def required_groups(mesh) -> tuple:
    """``mesh.required_groups()``, computed once per mesh: a pure function of the degrees
    that costs milliseconds of Python (~3 ms for a 4-rank mesh) and every job asks for it
    twice on every rank."""
    return tuple(mesh.required_groups())


#: survivors of a job's full collection above which the rank loop freezes them
FREEZE_OBJECTS = 20_000


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # parent gone (kernel killed): never linger as an orphan
        time.sleep(0.5)


def worker_main(rank: int, world_size: int, store_path: str, backend: str, device_type: str,
                threads: int, conn, parent_pid: int, sys_path: list, node=None) -> None:
    """Entry point of one rank process (the spawn target). ``node``: the
    :class:`labkit.nodes.NodeSpec` of the emulated node this rank lives in, entered first
    (a user namespace can only be entered while the process has one thread)."""
    if node is not None:
        from .nodes import enter

        try:
            enter(node)
        except BaseException:
            conn.send(("error", None, rank, traceback.format_exc()))
            return
    # A kernel interrupt may signal the whole process group; the parent alone decides
    # what an interrupt means (cancel and restart), so ranks ignore SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # startup stages, so a pool that cannot start says where it stopped (labkit.startup)
    conn.send(("progress", None, rank, "started"))
    sys.path[:] = list(dict.fromkeys(sys_path + sys.path))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from .trace import Tracer, use_tracer

    torch.set_num_threads(threads)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    conn.send(("progress", None, rank, "joining"))
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                **({"device_id": device} if device_type == "cuda" else {}))
    except BaseException:
        conn.send(("error", None, rank, traceback.format_exc()))
        return
    conn.send(("ready", None, rank, {"pid": os.getpid(), "device": str(device),
                                     "threads": torch.get_num_threads(),
                                     "torch_fr": bool(os.environ.get("TORCH_FR_BUFFER_SIZE"))}))
    from .faults.recorder import open_recorder
    from .mesh import ProcessGroups, mesh_from

    # the flight record the parent reads when this rank is stuck (labkit.faults.recorder)
    flight = open_recorder(recorder_path(store_path, rank))
    flight.start_heartbeat()  # the parent tells a frozen process from a waiting one
    if os.environ.get("TORCH_FR_BUFFER_SIZE"):
        threading.Thread(target=_dump_torch_fr, args=(flight, store_path, rank),
                         daemon=True).start()
    groups = ProcessGroups()
    cache: dict = {}
    import gc

    gc.freeze()  # torch's own objects live as long as the rank: keep them out of each collect
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # the parent closed the pipe
        kind, job_id = msg[0], msg[1]
        if kind == "close":
            break
        module, qualname, config, nranks = msg[2:]
        flight.begin_job(job_id)
        try:
            # every rank, idle ones too, creates the job's groups in the same order, once
            # per pool: new_group is collective over the whole world
            mesh = mesh_from(config)
            groups.ensure([range(nranks), *(required_groups(mesh) if mesh else ())])
            if rank >= nranks:
                conn.send(("idle", job_id, rank, None))
                continue
            job = resolve_job(module, qualname, reload_changed=True)
            tracer = Tracer(rank, device)
            ctx = RankContext(rank, nranks, device, groups.get(range(nranks)), backend, tracer,
                              cache, groups)
            with use_tracer(tracer), job_hooks_removed():
                out = job(ctx, config)
            conn.send(("result", job_id, rank, {"output": out,
                                                "events": tracer.packed()}))
        except BaseException:
            conn.send(("error", job_id, rank, traceback.format_exc()))
        # Nothing of a job outlives it but what the pool keeps on purpose (groups, cache):
        # drop this loop's references now rather than at the next job, collect the cycles
        # autograd and modules leave, and hand freed heap back to the OS, so a warm rank
        # stays the same size over hundreds of slider moves (benchmarks/soak.py).
        job = ctx = tracer = out = config = msg = None
        release_memory()
        # The first jobs import much of torch (dynamo, the memory and FLOP tools) and
        # labkit: ~125k objects that live as long as the rank, which every later collection
        # would walk again (~0.1 s of CPU per job, delaying the next run). Once that many
        # have survived a full collection, freeze them too. Below the threshold (the cache's
        # few thousand objects) nothing is frozen, so what the cache drops later is still
        # collected even if it holds a cycle.
        if len(gc.get_objects()) > FREEZE_OBJECTS:
            gc.freeze()
    # No destroy_process_group(): it waits for peers that may already be gone, and the
    # process is ending anyway. Exit at once, skipping interpreter teardown.
    os._exit(0)


def recorder_path(store_path: str, rank: int) -> str:
    """Where rank ``rank`` of the pool whose store is ``store_path`` keeps its flight record."""
    return os.path.join(os.path.dirname(store_path), f"flight{rank}")


def _dump_torch_fr(flight, store_path: str, rank: int) -> None:
    """Write torch's Flight Recorder to ``torch_fr{rank}.pkl`` when the parent asks: this
    thread runs while the main thread is blocked inside a collective (gloo's wait releases
    the GIL)."""
    import torch._C._distributed_c10d as c10d

    while True:
        time.sleep(0.1)
        if flight.dump_requested():
            try:
                data = c10d._dump_fr_trace()
                with open(os.path.join(os.path.dirname(store_path), f"torch_fr{rank}.pkl"),
                          "wb") as f:
                    f.write(data)
            finally:
                flight.dump_done()


@contextlib.contextmanager
def job_hooks_removed():
    """Remove, when the job ends, every post-accumulate-grad hook it registered on a tensor.

    A hook whose closure holds the module it serves (bucketed DDP, ZeRO/FSDP units: the
    hook sees ``self``, which holds the parameters) forms a reference cycle through
    autograd's C++ ``AccumulateGrad`` node, which Python's garbage collector cannot see. Each
    run's model, optimizer state and buffers would then stay in the rank for good: about
    1.4 MB per run of the tiny GPT, 280 MB after 200 slider moves. A job's hooks die with
    the job, so removing them breaks every such cycle.
    """
    import torch

    real = torch.Tensor.register_post_accumulate_grad_hook
    handles: list = []

    def register(tensor, hook):
        handle = real(tensor, hook)
        handles.append(handle)
        return handle

    torch.Tensor.register_post_accumulate_grad_hook = register
    try:
        yield
    finally:
        torch.Tensor.register_post_accumulate_grad_hook = real
        for handle in handles:
            handle.remove()


def release_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc ``malloc_trim``).

    Without the trim, glibc keeps the pages of freed tensors and autograd graphs in its
    arenas, and a long-lived rank's resident size creeps up with every job.
    """
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


def context_from_env() -> RankContext:
    """Join the process group that ``torchrun`` describes (env://) and build a context.

    Timestamps are aligned across nodes by a barrier: each rank's tracer offset makes the
    barrier's exit time zero (skew is the barrier's exit jitter, well under a millisecond
    on one node).
    """
    import torch
    import torch.distributed as dist

    from .trace import Tracer

    use_cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    dist.barrier()
    offset = -time.perf_counter()
    tracer = Tracer(dist.get_rank(), device, offset=offset)
    return RankContext(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD,
                       backend, tracer)
