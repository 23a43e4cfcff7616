"""``Cluster``: a warm pool of rank processes that runs jobs from a notebook cell.

Starting ranks costs seconds (each imports torch); running a job on warm ranks costs
milliseconds. So a cluster starts ``world_size`` processes once and keeps them, each with
its process group initialised, and ``run`` ships (job, config) to them over pipes.

Faults never hang the caller: a rank that raises becomes :class:`RankError` carrying the
remote traceback, a job past its timeout becomes ``TimeoutError``, a kernel interrupt
cancels the job (:class:`JobCancelled`, one line); in each case the ranks are killed and a
fresh pool starts in the background, so the next ``run`` works. A rank *process* that
died (SIGKILL, out of memory) is named as :class:`~labkit.faults.watch.RankDied` even when
a peer's failed collective reported first, and a job with ``watchdog_s`` whose ranks wait
in one collective longer than that raises :class:`~labkit.faults.watch.CollectiveHang`
saying which rank hung where (labkit's flight recorder, :mod:`labkit.faults.recorder`);
:attr:`Cluster.faults` keeps what was detected. A pool that cannot start
says why as soon as it is known, naming the stage each rank reached
(:mod:`labkit.startup`).

One pool per (world size, backend, device) per process: re-running a notebook's
``Cluster(4)`` cell stops the pool the previous ``Cluster(4)`` started (its ranks exit
within seconds), and the old object forwards ``run`` to the new one, so a widget still
holding it follows the new pool. ``replace=False`` asks for a pool of one's own.

``nodes=N`` places the ranks in N emulated nodes (:mod:`labkit.nodes`): private network
namespaces whose links to each other are shaped by Linux traffic control, so "inside a
server" and "across" differ on one machine. The pipes to the ranks are untouched by it.
"""
from __future__ import annotations

import atexit
import itertools
import os
import shutil
import time
import weakref
from multiprocessing.connection import wait as mp_wait
from typing import Optional, Union

from .cluster_run import JobRunner
from .nodes import DEFAULT_INTER_NODE, PLACEMENTS, EmulatedNetwork, node_of, parse_rate
from .preflight import check_world_size
from .result import JobCancelled, RankError, RunResult
from .startup import Startup, spawn_ranks
from .validate import ConfigError
from .worker import job_reference

__all__ = ["Cluster", "RunResult", "RankError", "JobCancelled", "job_reference"]

_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()
#: (world_size, backend, device) -> the Cluster whose pool is current for that key
_CURRENT: "dict[tuple, weakref.ref]" = {}



class Cluster(JobRunner):
    """A warm pool of ``world_size`` rank processes.

    Args:
        world_size: number of rank processes.
        backend: ``"auto"`` (NCCL with one GPU per rank when
            ``torch.cuda.device_count() >= world_size``, else gloo), ``"gloo"`` or ``"nccl"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``; follows the backend when ``"auto"``.
        timeout_s: default seconds a job may run before ``TimeoutError``.
        start_timeout_s: seconds the ranks may take to start and join the group.
        threads_per_rank: torch intra-op threads per rank; default cores // world_size
            (at least 1), so ranks do not oversubscribe the CPU.
        nodes: emulated nodes (:mod:`labkit.nodes`): ranks ``k·w … (k+1)·w − 1`` (``w =
            world_size / nodes``) live in node ``k``, so the mesh's innermost axis (tp)
            stays inside a node; each node has a private network namespace and its link to
            the others runs at ``inter_node``. Where the machine cannot build that (no
            user namespaces, no ``tc``), one line says so and the ranks run flat
            (:attr:`network` is ``None``, :attr:`network_note` the reason).
        inter_node: each node's link, per direction: bytes/s or a tc rate (``"1gbit"``).
        placement: ``"block"`` (above) or ``"cyclic"`` (rank ``r`` in node ``r % nodes``:
            the innermost axis crosses nodes, as if the mesh's order were reversed).
        latency_ms: one-way node-to-node delay; needs the kernel's ``netem`` (else one line
            says so and the links are shaped in bandwidth only).
        replace: become this process's pool for (world_size, backend, device): the pool of
            an earlier such ``Cluster`` (made with ``replace=True`` too) is stopped now, and
            that object's ``run`` forwards here (:attr:`current`). ``False``: a pool of its
            own, which neither replaces nor is replaced (several pools of one size).

    Raises:
        ConfigError: (a ``ValueError``; in a notebook its sentence shows without a
            traceback) a bad world size, backend or device, more CPU ranks than
            :func:`~labkit.preflight.check_world_size` allows, or ``nodes`` not dividing
            ``world_size``, before any process starts.
        ValueError: a bad ``inter_node`` rate.
    """

    def __init__(self, world_size: int = 4, backend: str = "auto", device: str = "auto",
                 timeout_s: float = 300.0, start_timeout_s: float = 120.0,
                 threads_per_rank: Optional[int] = None, replace: bool = True,
                 nodes: int = 1, inter_node: Union[str, float] = DEFAULT_INTER_NODE,
                 latency_ms: Optional[float] = None, placement: str = "block"):
        import torch

        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if backend == "auto":
            backend = "nccl" if (device != "cpu" and gpus >= world_size) else "gloo"
        if device == "auto":
            device = "cuda" if backend == "nccl" else "cpu"
        if (backend == "nccl" or device == "cuda") and gpus < world_size:
            raise ConfigError(f"backend={backend!r}/device={device!r} needs one GPU per rank: "
                             f"world_size={world_size} but {gpus} GPU(s) are visible")
        if backend == "nccl" and device != "cuda":
            raise ConfigError("backend 'nccl' needs device 'cuda'")
        if backend == "gloo" and device != "cuda":
            check_world_size(world_size)  # CPU ranks: at most a few per core
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"nodes must be a positive int, got {nodes!r}")
        if world_size % nodes:
            raise ConfigError(f"nodes={nodes} must divide world_size={world_size} (the same "
                             f"number of ranks in every node)")
        if placement not in PLACEMENTS:
            raise ConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.nodes, self.inter_node = nodes, parse_rate(inter_node)
        self.placement = placement
        self.latency_ms = latency_ms
        self.network: Optional[EmulatedNetwork] = None
        self.network_note: Optional[str] = None
        self.world_size, self.backend, self.device = world_size, backend, device
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self._procs: list = []
        self._conns: list = []
        self._tmp: Optional[str] = None
        self._ready = False
        self._ids = itertools.count()
        self.info: list = []
        self.restarts = 0
        #: :class:`labkit.faults.watch.FaultEvent` s detected so far, oldest first
        self.faults: list = []
        self.replace = bool(replace)
        self._successor: Optional[weakref.ref] = None
        self._start()
        _LIVE.add(self)

    # -- one pool per key ------------------------------------------------------------
    @property
    def _key(self) -> tuple:
        return (self.world_size, self.backend, self.device)

    def _claim(self) -> None:
        """Make this the current pool of its key; stop the one it replaces."""
        if not self.replace:
            return
        self._successor = None
        ref = _CURRENT.get(self._key)
        old = ref() if ref is not None else None
        _CURRENT[self._key] = weakref.ref(self)
        if old is not None and old is not self:
            old._successor = weakref.ref(self)
            old.close()

    @property
    def current(self) -> "Cluster":
        """The cluster ``run`` uses: this one, or the newer ``Cluster`` of the same world
        size, backend and device that replaced it (a re-run notebook cell)."""
        c, seen = self, set()
        while c._successor is not None and id(c) not in seen:
            seen.add(id(c))
            nxt = c._successor()
            if nxt is None:
                break
            c = nxt
        return c

    @property
    def replaced(self) -> bool:
        """True when a newer ``Cluster`` replaced this one's pool (``run`` forwards to it)."""
        return self.current is not self

    def node_of(self, rank: int) -> int:
        """The emulated node ``rank`` lives in (0 when the cluster is one node)."""
        return node_of(rank, self.world_size, self.nodes, self.placement)

    # -- lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        specs = None
        if self.nodes > 1 and self.network_note is None:
            if self.network is None or not self.network.alive:
                if self.network is not None:
                    self.network.close()
                try:
                    self.network = EmulatedNetwork(self.nodes, self.inter_node,
                                                   self.latency_ms)
                except OSError as exc:
                    self.network, self.network_note = None, f"{exc}; the ranks run flat"
                    print(f"labkit: {self.network_note}")
            if self.network is not None:
                specs = [self.network.spec(self.node_of(r)) for r in range(self.world_size)]
        self._procs, self._conns, self._tmp = spawn_ranks(
            self.world_size, self.backend, self.device, self.threads_per_rank, specs)
        self._ready = False
        self._startup = Startup(self.world_size, self.start_timeout_s)
        self._claim()

    def _wait_ready(self, block: bool = True) -> bool:
        """Collect the ranks' startup messages; True once every rank joined the group.

        ``block=False`` only reads what has arrived. Raises ``RankError`` (a rank raised
        or died while starting: the message names the stage it reached) or
        ``TimeoutError`` (the start timeout, or ranks stuck in ``init_process_group`` for
        :data:`labkit.startup.JOIN_TIMEOUT_S`); either way the ranks are stopped and the
        next ``run`` starts fresh ones.
        """
        if self._ready:
            return True
        st = self._startup
        while st.pending:
            now = time.perf_counter()
            err = st.overdue(now)
            if err is not None:
                self._kill()
                raise err
            wait = min(st.deadline - now, 0.5) if block else 0.0
            kind, rank, payload = self._next_message(st.pending, wait)
            if kind is None:
                if not block:
                    return False
                continue
            if kind == "error":
                err = st.failed(rank, payload)
                self._kill()
                raise err
            st.note(kind, rank, payload)
        self.info, self._ready = st.info, True
        return True

    def ready(self) -> bool:
        """True when every rank has joined the process group, without waiting: a ``run``
        now starts at once. False while a pool starts (or after ``close``); a widget shows
        "starting ranks…" then. Raises what a failed start raises (see ``run``)."""
        c = self.current
        if not c._procs:
            return False
        return c._wait_ready(block=False) and c.alive

    def _next_message(self, ranks, timeout):
        """One (kind, rank, payload) from ``ranks``' pipes; a dead rank is an error."""
        conns = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks}
        ready = mp_wait(list(conns) + list(sentinels), timeout)
        for obj in ready:
            if obj in conns:
                try:
                    kind, _job, rank, payload = obj.recv()
                    return kind, rank, payload
                except (EOFError, OSError):
                    return "error", conns[obj], self._death_note(conns[obj])
        for obj in ready:
            if obj in sentinels and not self._conns[sentinels[obj]].poll():
                return "error", sentinels[obj], self._death_note(sentinels[obj])
        return None, None, None

    def _death_note(self, r: int) -> str:
        p = self._procs[r]
        p.join(timeout=1)
        return (f"rank process {r} (pid {p.pid}) died with exit code {p.exitcode} before "
                "reporting (killed, out of memory, or crashed in native code)")

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns, self._ready = [], [], False
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def restart(self) -> None:
        """Kill the ranks and start a fresh pool (non-blocking; the next run waits)."""
        if self.replaced:
            return self.current.restart()
        self._kill()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        """Stop every rank process. Safe to call twice."""
        for c in self._conns:
            try:
                c.send(("close", None))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.perf_counter() + 3.0  # one budget for all ranks, then kill
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.perf_counter()))
        self._kill()
        if self.network is not None:
            self.network.close()
            self.network = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list:
        return [p.pid for p in self._procs]

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._kill()
            if self.network is not None:
                self.network.close()
        except Exception:
            pass

    @property
    def state(self) -> str:
        """``"warm"``, ``"starting"``, ``"closed"``, ``"broken"`` (a rank exited while idle;
        the next run restarts) or ``"replaced"`` (``run`` forwards to :attr:`current`)."""
        if self.replaced:
            return "replaced"
        return ("closed" if not self._procs else "starting" if not self._ready
                else "warm" if self.alive else "broken")

    def __repr__(self) -> str:
        state = self.state
        if state == "replaced":
            state = f"replaced by a newer {self.current!r}: run() goes there"
        elif state == "broken":
            state = "broken: a rank exited; the next run restarts"
        nodes = ""
        if self.nodes > 1:
            flat = self.network is None and self.network_note is not None
            nodes = (f"nodes={self.nodes}, inter_node={self.inter_node * 8 / 1e6:,.0f} Mbit/s"
                     f"{' (flat: no emulated nodes here)' if flat else ''}, ")
        return (f"Cluster(world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device!r}, {nodes}{state})")


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        try:
            c._kill()
            if c.network is not None:
                c.network.close()
        except Exception:
            pass
