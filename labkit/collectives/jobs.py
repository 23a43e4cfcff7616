"""Cluster jobs that run one collective, native or hand-built, and report what happened.

* :func:`collective` (job) — one op by name and algorithm on given (or default) inputs;
  each rank returns its input, its output, its per-step record and the bytes
  :mod:`labkit.comm` counted.
* :func:`parity` (job) — many (op, algorithm, reduce, dtype, size) cases on the same seeded
  inputs, native and hand-built side by side, for the parity tests.
* :func:`run` (caller side) — validate, run :func:`collective` on the warm cluster with
  ``nranks=N``, merge the records and put the formula bytes beside the counted ones.

Default inputs follow one rule so values are readable in tables and animations: **chunk j of
rank r holds 10·r + j** (rank r's input is an (N, m) array; all-gather: rank r's (m,)
input holds 10·r; broadcast: non-root ranks start from zeros).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import comm
from . import (_REDUCING, check_algorithm, check_divisible, check_reduce,
               formula_bytes)
from .record import Recorder, Recording, merge, record_native

__all__ = ["CollectiveConfig", "ParityConfig", "CollectiveRun", "collective", "parity", "run",
           "default_inputs", "execute", "DTYPES"]

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32,
          "float64": torch.float64}
#: tensors up to this many elements are recorded step by step; larger ones are not
RECORD_MAX_NUMEL = 4096


def _shape(nested) -> tuple:
    shape = []
    while isinstance(nested, (list, tuple)):
        shape.append(len(nested))
        nested = nested[0] if nested else 0
    return tuple(shape)


def default_inputs(op: str, n: int, m: int = 1, root: int = 0) -> tuple:
    """Per-rank inputs: chunk j of rank r = 10·r + j, as (N, m) nested lists (see module)."""
    if op == "all_gather":
        return tuple([10 * r] * m for r in range(n))
    rows = lambda r: [[10 * r + j] * m for j in range(n)]  # noqa: E731
    if op == "broadcast":
        return tuple(rows(r) if r == root else [[0] * m for _ in range(n)] for r in range(n))
    return tuple(rows(r) for r in range(n))


@dataclass(frozen=True)
class CollectiveConfig:
    """One collective to run.

    Attributes:
        op: one of :data:`labkit.collectives.OPS`.
        algorithm: ``"native"`` or a hand-built algorithm of that op.
        nranks: N, the ranks taking part (≤ the cluster's size).
        inputs: per-rank nested lists (any shape the op accepts); ``None`` → defaults.
        m: elements per chunk of the default inputs.
        dtype: ``"int64"``, ``"int32"``, ``"float32"`` or ``"float64"``.
        reduce: ``sum``, ``max``, ``min``, ``avg`` (floats only) or ``product``.
        root: source of broadcast / destination of reduce (group rank).
        record: keep per-step records (hand-built only, ≤ RECORD_MAX_NUMEL elements).
        list_form: native all-to-all through the list API (lists of tensors).
    """

    op: str = "all_reduce"
    algorithm: str = "native"
    nranks: int = 4
    inputs: Optional[tuple] = None
    m: int = 1
    dtype: str = "int64"
    reduce: str = "sum"
    root: int = 0
    record: bool = True
    list_form: bool = False
    timeout_s: float = 60.0

    def resolved_inputs(self) -> tuple:
        return self.inputs if self.inputs is not None else default_inputs(
            self.op, self.nranks, self.m, self.root)

    def validate(self, world_size: int) -> "CollectiveConfig":
        """Check everything before any rank is touched; raises ``ValueError`` naming it."""
        check_algorithm(self.op, self.algorithm)
        n = self.nranks
        if not 1 <= n <= world_size:
            raise ValueError(f"nranks={n} must be between 1 and the cluster's size {world_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.op in _REDUCING:
            check_reduce(self.reduce, DTYPES[self.dtype])
        if not 0 <= self.root < n:
            raise ValueError(f"root={self.root} must be a rank below nranks={n}")
        inputs = self.resolved_inputs()
        if len(inputs) != n:
            raise ValueError(f"inputs has {len(inputs)} entries, one per rank is needed (N={n})")
        shapes = {_shape(x) for x in inputs}
        if len(shapes) != 1:
            raise ValueError(f"every rank's input must have the same shape, got {sorted(shapes)}")
        shape = shapes.pop()
        numel = 1
        for d in shape:
            numel *= d
        if self.op == "reduce_scatter":
            check_divisible(numel, n, "reduce_scatter")
        if self.op == "all_to_all":
            check_divisible(shape[0] if shape else 1, n, "all_to_all (dim 0 of the input)")
        return self


def _n_chunks(op: str, algorithm: str, n: int) -> int:
    if op in ("broadcast", "reduce") or algorithm == "recursive_doubling":
        return 1
    return n


def message_bytes(op: str, algorithm: str, x: torch.Tensor, n: int) -> int:
    """S of the formulas: the all-gather output, the (padded, for the ring) all-reduce
    buffer, else this rank's input."""
    s = comm.nbytes(x)
    if op == "all_gather":
        return n * s
    if op == "all_reduce" and algorithm == "ring":
        return -(-x.numel() // n) * n * x.element_size()
    return s


def execute(op: str, algorithm: str, x: torch.Tensor, group, reduce: str = "sum",
            root: int = 0, recorder: Optional[Recorder] = None,
            list_form: bool = False) -> Optional[torch.Tensor]:
    """Run ``op`` on this rank's input ``x`` (left unchanged); returns the output tensor
    (``None`` on non-root ranks of a reduce). ``root`` is a group rank."""
    from . import pairwise, ring, tree

    n, ranks = comm.group_size(group), comm.group_ranks(group)
    hand = algorithm != "native"
    if op == "all_reduce":
        out = x.clone()
        if algorithm == "ring":
            return ring.all_reduce(out, reduce, group, recorder)
        if algorithm == "recursive_doubling":
            return tree.all_reduce_recursive_doubling(out, reduce, group, recorder)
        comm.all_reduce(out, reduce, group)
        return out
    if op == "reduce_scatter":
        k = x.numel() // n
        shape = x.shape[1:] if x.dim() >= 2 and x.shape[0] == n else (k,)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        if hand:
            return ring.reduce_scatter(out, x, reduce, group, recorder)
        comm.reduce_scatter(out.view(-1), x.reshape(-1).contiguous(), reduce, group)
        return out
    if op == "all_gather":
        out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        if hand:
            return ring.all_gather(out, x, group, recorder)
        comm.all_gather(out.view(-1), x.reshape(-1).contiguous(), group)
        return out
    if op == "all_to_all":
        out = torch.empty_like(x)
        if hand:
            return pairwise.all_to_all(out, x, group, recorder)
        if list_form:
            return _all_to_all_list(out, x, group)
        comm.all_to_all(out, x.contiguous(), group)
        return out
    if op == "broadcast":
        out = x.clone()
        if hand:
            return tree.broadcast(out, ranks[root], group, recorder)
        comm.broadcast(out, ranks[root], group)
        return out
    if op == "reduce":
        out = x.clone()
        if hand:
            return tree.reduce(out, ranks[root], reduce, group, recorder)
        comm.reduce(out, ranks[root], reduce, group)
        return out if comm.group_ranks(group)[root] == torch.distributed.get_rank() else None
    raise ValueError(f"unknown collective {op!r}")


def _all_to_all_list(out: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """The list form (``inputs[j]`` → rank j); where the backend lacks it, the single-tensor
    form moves the same chunks instead of erroring."""
    n = comm.group_size(group)
    ins, outs = list(x.contiguous().chunk(n)), list(out.chunk(n))
    try:
        comm.all_to_all_list(outs, ins, group)
    except (RuntimeError, NotImplementedError) as exc:
        if "support" not in str(exc).lower():
            raise
        comm.all_to_all(out, x.contiguous(), group)
    return out


def collective(ctx, cfg: CollectiveConfig) -> dict:
    """Job: run ``cfg.op`` with ``cfg.algorithm`` on this rank's input.

    Returns ``{"rank", "input", "output" (None on a reduce's non-root ranks), "record"
    (Recorder data or None), "bytes_sent", "bytes_recv", "message_bytes", "time_s"}``.
    """
    x = torch.tensor(cfg.resolved_inputs()[ctx.rank], dtype=DTYPES[cfg.dtype],
                     device=ctx.device)
    record = cfg.record and x.numel() <= RECORD_MAX_NUMEL
    rec = Recorder(ctx.rank) if record else None
    first = len(ctx.tracer.events)
    t0 = time.perf_counter()
    out = execute(cfg.op, cfg.algorithm, x, ctx.group, cfg.reduce, cfg.root,
                  rec if cfg.algorithm != "native" else None, cfg.list_form)
    elapsed = time.perf_counter() - t0
    events = ctx.tracer.events[first:]
    if rec is not None and cfg.algorithm == "native":
        record_native(rec, cfg.op, x, out, ctx.world_size, ctx.rank,
                      _n_chunks(cfg.op, "native", ctx.world_size))
    return {"rank": ctx.rank, "input": x.tolist(),
            "output": None if out is None else out.tolist(),
            "record": rec.to_data() if rec is not None else None,
            "bytes_sent": sum(e.bytes_sent for e in events),
            "bytes_recv": sum(e.bytes_recv for e in events),
            "message_bytes": message_bytes(cfg.op, cfg.algorithm, x, ctx.world_size),
            "time_s": elapsed}


@dataclass(frozen=True)
class ParityConfig:
    """Cases ``(op, algorithm, reduce, dtype, numel)`` to check against native on N ranks.
    ``numel`` is each rank's input size (a multiple of N where the op needs one)."""

    nranks: int
    cases: tuple
    seed: int = 0
    timeout_s: float = 120.0

    def validate(self, world_size: int) -> "ParityConfig":
        if not 1 <= self.nranks <= world_size:
            raise ValueError(f"nranks={self.nranks} must be between 1 and {world_size}")
        for op, algorithm, reduce, dtype, numel in self.cases:
            CollectiveConfig(op, algorithm, self.nranks, dtype=dtype, reduce=reduce).validate(
                world_size)
            if op in ("reduce_scatter", "all_to_all"):
                check_divisible(numel, self.nranks, op)
        return self


def parity(ctx, cfg: ParityConfig) -> list:
    """Job: for each case, native and hand-built outputs on the same seeded input.

    Returns one dict per case: ``{"case", "native", "hand", "bytes_sent", "bytes_recv",
    "message_bytes"}`` (bytes of the hand-built run, outputs as lists or None)."""
    results = []
    for i, (op, algorithm, reduce, dtype, numel) in enumerate(cfg.cases):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i * 1009 + ctx.rank)
        dt = DTYPES[dtype]
        if dt.is_floating_point:
            x = (torch.rand(numel, generator=g, dtype=dt) * 2 - 1).to(ctx.device)
        else:
            x = torch.randint(-50, 50, (numel,), generator=g, dtype=dt).to(ctx.device)
        if op == "all_to_all":
            x = x.view(ctx.world_size, -1)
        native = execute(op, "native", x, ctx.group, reduce, 0)
        first = len(ctx.tracer.events)
        hand = execute(op, algorithm, x, ctx.group, reduce, 0)
        events = ctx.tracer.events[first:]
        results.append({"case": (op, algorithm, reduce, dtype, numel),
                        "native": None if native is None else native.tolist(),
                        "hand": None if hand is None else hand.tolist(),
                        "bytes_sent": sum(e.bytes_sent for e in events),
                        "bytes_recv": sum(e.bytes_recv for e in events),
                        "message_bytes": message_bytes(op, algorithm, x, ctx.world_size)})
    return results


@dataclass
class CollectiveRun:
    """One op on the cluster, merged (see :func:`run`). Bytes are per rank, each way."""

    config: CollectiveConfig
    inputs: list
    outputs: list
    recording: Optional[Recording]
    bytes_sent: list
    bytes_recv: list
    formula: list
    message_bytes: int
    time_s: float
    wall_s: float
    result: Any = field(default=None, repr=False)

    @property
    def bytes_match(self) -> bool:
        """Counted bytes equal the formula on every rank, both ways."""
        return all(abs(s - f[0]) < 1e-6 and abs(r - f[1]) < 1e-6
                   for s, r, f in zip(self.bytes_sent, self.bytes_recv, self.formula))


def run(cluster, op: str, algorithm: str = "native", n: Optional[int] = None,
        **config) -> CollectiveRun:
    """Run one collective on ``n`` ranks of a warm ``cluster`` (default: all of them).

    ``config`` takes the other :class:`CollectiveConfig` fields (``inputs``, ``dtype``,
    ``reduce``, ``root``, ``m``, ``record``, ``list_form``). Validates first: a bad
    combination raises ``ValueError`` before any rank is touched.
    """
    n = cluster.world_size if n is None else n
    cfg = CollectiveConfig(op, algorithm, n, **config).validate(cluster.world_size)
    res = cluster.run(collective, cfg, nranks=n)
    outs = res.outputs
    recs = [o["record"] for o in outs]
    recording = merge(recs, op, algorithm) if all(r is not None for r in recs) else None
    s = outs[0]["message_bytes"]
    formula = [formula_bytes(op, n, s, algorithm, r, cfg.root) for r in range(n)]
    return CollectiveRun(cfg, [o["input"] for o in outs], [o["output"] for o in outs],
                         recording, [o["bytes_sent"] for o in outs],
                         [o["bytes_recv"] for o in outs], formula, s,
                         max(o["time_s"] for o in outs), res.wall_s, res)
