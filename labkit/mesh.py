"""The device mesh: named parallel axes over the ranks, and process groups cached per pool.

A :class:`Mesh` is a frozen, picklable description: degrees for the axes, outer to inner,

    ``pp, dp_replicate, dp_shard, cp, tp``

(the order of Megatron-Core and torchtitan). Global rank ``r`` is the row-major index of its
coordinates, so ``tp`` is innermost: the ranks of one tensor-parallel group are adjacent,
which on a real server puts them in one NVLink domain, while ``pp``, outermost, crosses
servers. Flattened views combine axes:

=============  ================================  =============================================
view           axes                              used for
=============  ================================  =============================================
``dp``         dp_replicate × dp_shard           data loading: which slice of the batch
``dp_cp``      dp_replicate × dp_shard × cp      the loss and dense-gradient reduction
``fsdp``       dp_shard × cp                     the ZeRO/FSDP shard group
``ep``         a second view of ``dp_cp``        expert parallelism (never adds ranks)
``edp``        ``dp_cp`` ranks of one expert     the expert parameters' gradient reduction
=============  ================================  =============================================

Expert parallelism splits each ``dp_cp`` group (the ranks of one ``(pp, tp)`` coordinate)
into consecutive blocks of ``ep`` ranks: the experts of a layer are divided over a block
(the ``ep`` group), and ranks at the same position in different blocks hold the same experts
(the ``edp`` group). So ``ep`` must divide ``dp_replicate · dp_shard · cp``.

Process groups are not part of the description: :class:`ProcessGroups` creates them on every
rank of a pool in one deterministic order and keeps them for the pool's life, keyed by the
sorted rank tuple (``torch.distributed.new_group`` numbers its groups by call count, so all
ranks — idle ones too — must create the same groups in the same order, and creating one per
slider move would leak them; ``init_device_mesh`` does exactly that). :class:`MeshGroups`
binds a mesh, a rank and the cache, and answers ``group("tp")``, ``index("dp")`` and
``device_mesh(...)`` for PyTorch's own code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

__all__ = ["AXES", "VIEWS", "Mesh", "ProcessGroups", "MeshGroups"]

#: mesh axes, outer to inner
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: flattened views: name -> axes (in AXES order)
VIEWS = {"dp": ("dp_replicate", "dp_shard"),
         "dp_cp": ("dp_replicate", "dp_shard", "cp"),
         "fsdp": ("dp_shard", "cp")}
#: every group a training job may use, in the order groups are created
GROUP_ORDER = ("tp", "cp", "dp_shard", "fsdp", "dp_replicate", "dp", "dp_cp", "ep", "edp",
               "pp")

Axes = Union[str, Sequence[str]]


@dataclass(frozen=True)
class Mesh:
    """Degrees of each axis; ``size`` = their product (``ep`` is a view and adds nothing).

    Raises:
        ValueError: a degree that is not a positive int, or ``ep`` not dividing
            ``dp_replicate · dp_shard · cp`` (names the numbers).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in AXES + ("ep",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Mesh.{name} must be a positive int, got {v!r}")
        data = self.dp_replicate * self.dp_shard * self.cp
        if data % self.ep:
            raise ValueError(f"ep={self.ep} must divide the data ranks dp_replicate x dp_shard x "
                             f"cp = {self.dp_replicate} x {self.dp_shard} x {self.cp} = {data}: "
                             "expert parallelism is a view over them and adds no ranks")

    # -- shape -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """Degrees in :data:`AXES` order."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def size(self) -> int:
        """Ranks the mesh spans."""
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def degree(self, axes: Axes) -> int:
        """Ranks in one group of ``axes`` (an axis, a view name or a tuple of axes)."""
        if axes == "ep":
            return self.ep
        if axes == "edp":
            return self.degree("dp_cp") // self.ep
        return math.prod(getattr(self, a) for a in _axes(axes))

    # -- coordinates -------------------------------------------------------------------
    def coords(self, rank: int) -> dict:
        """``{axis: coordinate}`` of global ``rank`` (row-major, ``tp`` fastest).

        Raises:
            ValueError: ``rank`` outside ``[0, size)``.
        """
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.size} ranks")
        out, rest = {}, rank
        for a in reversed(AXES):
            rest, out[a] = divmod(rest, getattr(self, a))
        return {a: out[a] for a in AXES}

    def rank(self, **coords) -> int:
        """Global rank of the given coordinates (missing axes are 0)."""
        r = 0
        for a in AXES:
            c, n = coords.get(a, 0), getattr(self, a)
            if not 0 <= c < n:
                raise ValueError(f"coordinate {a}={c} is outside 0..{n - 1}")
            r = r * n + c
        return r

    def group(self, rank: int, axes: Axes) -> tuple:
        """Global ranks that share every coordinate of ``rank`` except ``axes``, ascending;
        the rank's position in the tuple is its group rank (what ``new_group`` gives)."""
        if axes in ("ep", "edp"):
            block, pos = self._ep_place(rank)
            data = self.group(rank, "dp_cp")
            if axes == "ep":
                return data[block * self.ep:(block + 1) * self.ep]
            return data[pos::self.ep]
        names = _axes(axes)
        base = self.coords(rank)
        out = []
        for idx in range(self.degree(names)):
            c, rest = dict(base), idx
            for a in reversed(names):
                rest, c[a] = divmod(rest, getattr(self, a))
            out.append(self.rank(**c))
        return tuple(sorted(out))

    def index(self, rank: int, axes: Axes) -> int:
        """``rank``'s position within its ``axes`` group (0 … degree−1)."""
        return self.group(rank, axes).index(rank)

    def groups(self, axes: Axes) -> list:
        """Every group of ``axes``: a partition of ``range(size)``, in order of first rank."""
        seen, out = set(), []
        for r in range(self.size):
            g = self.group(r, axes)
            if g not in seen:
                seen.add(g)
                out.append(g)
        return out

    def required_groups(self) -> list:
        """Every rank tuple a job on this mesh may communicate over, deduplicated, in the
        fixed :data:`GROUP_ORDER`: what each pool rank creates before the job starts."""
        seen, out = set(), []
        for name in GROUP_ORDER:
            # HSDP with one shard per replica group still needs its (one-rank) shard group
            single = name == "fsdp" and self.dp_replicate > 1
            for g in self.groups(name):
                if (len(g) > 1 or single) and g not in seen:
                    seen.add(g)
                    out.append(g)
        return out

    def _ep_place(self, rank: int) -> tuple:
        """``(block, position)`` of ``rank`` among its ``dp_cp`` group's ``ep`` blocks."""
        return divmod(self.index(rank, "dp_cp"), self.ep)

    def describe(self) -> str:
        """A few lines for notebooks and the CLI: the degrees and who shares each axis."""
        dims = " x ".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) > 1)
        lines = [f"Mesh {dims or 'single rank'} ({self.size} ranks"
                 + (f", ep={self.ep} over dp_cp" if self.ep > 1 else "") + ")"]
        for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp", "ep"):
            if self.degree(name) > 1:
                lines.append(f"  {name:<12} groups: {' '.join(_fmt(g) for g in self.groups(name))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _axes(axes: Axes) -> tuple:
    names = VIEWS.get(axes, (axes,)) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in AXES:
            raise ValueError(f"unknown mesh axis {a!r}; axes are {', '.join(AXES)}, views "
                             f"{', '.join(VIEWS)}, and ep/edp")
    return tuple(a for a in AXES if a in names)


def _fmt(g: tuple) -> str:
    return "(" + ",".join(map(str, g)) + ")"


class ProcessGroups:
    """The process groups of one pool (one ``init_process_group``), keyed by sorted ranks.

    ``ensure(tuples)`` must be called by **every** rank of the world with the same list:
    ``new_group`` is collective over the whole world. Tuples already cached cost nothing,
    so re-running a configuration creates no group (``created`` counts the groups made).
    The whole world's tuple maps to the default group.
    """

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        world = tuple(range(dist.get_world_size()))
        self._groups: dict = {world: dist.group.WORLD}
        self.created = 0

    def ensure(self, tuples: Iterable[Sequence[int]]) -> None:
        for t in tuples:
            key = tuple(sorted(t))
            if key not in self._groups:
                self._groups[key] = self._dist.new_group(list(key))
                self.created += 1

    def get(self, ranks: Sequence[int]):
        """The group of ``ranks``.

        Raises:
            KeyError: the group was not created with :meth:`ensure` (naming the ranks).
        """
        key = tuple(sorted(ranks))
        try:
            return self._groups[key]
        except KeyError:
            raise KeyError(f"no process group for ranks {key}: every rank of the pool must "
                           "create it first (ProcessGroups.ensure)") from None

    def __len__(self) -> int:
        return len(self._groups)


class MeshGroups:
    """A mesh seen from one rank, with its process groups.

    ``group(axes)`` is ``None``-free: a degree-1 axis gives ``None`` only through
    :meth:`maybe_group`; communication code should skip degree-1 axes (``size(axes) == 1``).
    """

    def __init__(self, mesh: Mesh, rank: int, groups: ProcessGroups):
        self.mesh, self.rank, self.cache = mesh, rank, groups
        self.coords = mesh.coords(rank)

    def ranks(self, axes: Axes) -> tuple:
        return self.mesh.group(self.rank, axes)

    def size(self, axes: Axes) -> int:
        return len(self.ranks(axes))

    def index(self, axes: Axes) -> int:
        return self.mesh.index(self.rank, axes)

    def group(self, axes: Axes):
        """The process group of this rank's ``axes`` group.

        Raises:
            ValueError: the axis has degree 1 here (nothing to communicate with).
        """
        ranks = self.ranks(axes)
        if len(ranks) == 1:
            raise ValueError(f"axis {axes!r} has degree 1: no group to communicate over")
        return self.cache.get(ranks)

    def maybe_group(self, axes: Axes):
        """:meth:`group`, or ``None`` for a degree-1 axis."""
        return self.group(axes) if self.size(axes) > 1 else None

    def device_mesh(self, axes: Sequence[str], device_type: str = "cpu"):
        """A ``torch.distributed.device_mesh.DeviceMesh`` over this rank's sub-mesh of
        ``axes`` (each a mesh axis or view name), built from the cached groups with
        ``DeviceMesh.from_group``: for PyTorch's own FSDP2 and tensor parallelism."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        names = tuple(axes)
        parts = [a for n in names for a in _axes(n)]
        if parts != [a for a in AXES if a in parts]:
            raise ValueError(f"device_mesh{names}: axes must be given outer to inner "
                             f"({', '.join(AXES)})")
        shape = [self.mesh.degree(a) for a in names]
        ranks = torch.tensor(self.mesh.group(self.rank, tuple(parts))).view(*shape)
        if min(shape) < 2:
            raise ValueError(f"device_mesh{names}: every axis needs degree > 1 here "
                             f"(degrees {dict(zip(names, shape))})")
        groups = [self.cache.get(self.mesh.group(self.rank, a)) for a in names]
        if len(names) == 1:
            return DeviceMesh.from_group(groups[0], device_type, mesh_dim_names=names)
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)

    def describe(self) -> str:
        c = ", ".join(f"{a}={v}" for a, v in self.coords.items() if getattr(self.mesh, a) > 1)
        return f"rank {self.rank}: {c or 'no parallel axes'}"


def mesh_from(x) -> Optional[Mesh]:
    """The mesh of a config (``x.mesh``) or ``None``: what a rank creates groups for."""
    m = getattr(x, "mesh", None)
    return m if isinstance(m, Mesh) else None
