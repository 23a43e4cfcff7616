"""Per-step records of a hand-built collective: which chunk moved where, and what it held.

A rank's buffer is a row of ``n_chunks`` chunks (the ring algorithms and the all-to-all
split it in N; the tree and recursive-doubling algorithms move it whole, ``n_chunks = 1``).
Step 0 is the state before any message; step ``s ≥ 1`` is the state after the s-th round of
messages. Each rank records

* the moves it *received* at each step (:class:`Move`: step, source rank, destination
  rank, chunk index, whether it was copied or reduced, bytes, and the chunk's values at the
  destination after the step), and
* a snapshot of its buffer after each step: one list of values per chunk, or ``None``
  where the chunk holds nothing meaningful (not received yet, or a reduce's non-root
  buffer after it passed its partial sum on).

Everything is plain data (dataclasses of ints, strings, tuples and lists), so it crosses
the rank pipes and :func:`merge` can combine the ranks into one :class:`Recording` that the
animation (``labkit_widgets.CollectiveView``) draws from. Recording copies values, so it is
meant for small tensors: values are truncated to ``max_values`` elements per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["Move", "Recorder", "Recording", "merge", "cell", "chunks_of", "record_native"]


@dataclass(frozen=True)
class Move:
    """One chunk received at one step.

    Attributes:
        step: 1-based round of messages.
        src, dst: group ranks that sent and received (equal for a local copy).
        chunk: chunk index in ``dst``'s buffer.
        src_chunk: chunk index in ``src``'s buffer (differs from ``chunk`` only for
            all-to-all, where chunk j of rank i lands in chunk i of rank j).
        kind: ``"copy"`` (overwrites), ``"reduce"`` (combined into what dst held) or
            ``"local"`` (a copy inside one rank: no bytes).
        phase: e.g. ``"reduce-scatter"``, ``"all-gather"``, ``"exchange"``.
        nbytes: bytes of the message (0 for ``"local"``).
        values: the chunk at ``dst`` after the step (first ``max_values`` elements).
        from_input: the source is ``src``'s separate input buffer (all-to-all), not the
            buffer the snapshots show.
    """

    step: int
    src: int
    dst: int
    chunk: int
    src_chunk: int
    kind: str
    phase: str
    nbytes: int
    values: Optional[tuple] = None
    from_input: bool = False


def cell(t, max_values: int = 64) -> Optional[list]:
    """A chunk tensor → a list of its first ``max_values`` values (``None`` stays ``None``)."""
    if t is None:
        return None
    return t.detach().reshape(-1)[:max_values].cpu().tolist()


def chunks_of(t, n: int) -> list:
    """``t`` flattened and cut into ``n`` equal views (one view when ``n`` does not divide)."""
    flat = t.reshape(-1)
    if n <= 1 or flat.numel() % n:
        return [flat]
    k = flat.numel() // n
    return [flat[i * k:(i + 1) * k] for i in range(n)]


class Recorder:
    """Collects one rank's moves and snapshots while an algorithm runs.

    Algorithms take ``recorder=None`` and skip all recording when it is ``None`` (the
    benchmark path); with a recorder they call :meth:`inputs` once, :meth:`recv` for each
    chunk received, and :meth:`end_step` after every round, idle rounds included.
    """

    def __init__(self, rank: int, max_values: int = 64):
        self.rank, self.max_values = rank, max_values
        self.moves: list[Move] = []
        self.snapshots: list[list] = []
        self.phases: list[str] = []
        self.input_cells: list = []
        self.separate_output = False
        self._pending: list[dict] = []

    def inputs(self, chunks: Sequence, separate_output: bool = False) -> None:
        """The rank's input, one entry per chunk (tensor or ``None``)."""
        self.input_cells = [cell(c, self.max_values) for c in chunks]
        self.separate_output = separate_output

    def recv(self, step: int, src: int, chunk: int, nbytes: int, kind: str = "copy",
             src_chunk: Optional[int] = None, phase: str = "", from_input: bool = False) -> None:
        """This rank received ``chunk`` from ``src`` at ``step`` (values filled at end_step)."""
        self._pending.append(dict(step=step, src=src, dst=self.rank, chunk=chunk,
                                  src_chunk=chunk if src_chunk is None else src_chunk,
                                  kind=kind, phase=phase, nbytes=int(nbytes),
                                  from_input=from_input))

    def end_step(self, step: int, chunks: Sequence, phase: str = "") -> None:
        """Snapshot the buffer after ``step`` (0 = before any message)."""
        if step != len(self.snapshots):
            raise RuntimeError(f"end_step({step}) after {len(self.snapshots)} snapshots: "
                               "steps must be recorded in order, idle steps included")
        cells = [cell(c, self.max_values) for c in chunks]
        self.snapshots.append(cells)
        self.phases.append(phase)
        for m in self._pending:
            vals = cells[m["chunk"]] if m["chunk"] < len(cells) else None
            self.moves.append(Move(values=None if vals is None else tuple(vals), **m))
        self._pending = []

    def to_data(self) -> dict:
        return {"rank": self.rank, "moves": list(self.moves), "snapshots": self.snapshots,
                "phases": self.phases, "inputs": self.input_cells,
                "separate_output": self.separate_output}


@dataclass
class Recording:
    """All ranks' records of one run, merged.

    Attributes:
        op, algorithm: what ran.
        world_size: N.
        n_chunks: chunks per rank's buffer.
        inputs: ``[rank][chunk]`` values before the op (``None`` = empty).
        snapshots: ``[step][rank][chunk]`` values after each step (step 0 = start).
        phases: ``[step]`` phase name of each step.
        moves: every :class:`Move`, ordered by step then destination.
        separate_output: the algorithm writes a buffer apart from its input (all-to-all).
    """

    op: str
    algorithm: str
    world_size: int
    n_chunks: int
    inputs: list
    snapshots: list
    phases: list
    moves: list = field(default_factory=list)
    separate_output: bool = False

    @property
    def steps(self) -> int:
        """Rounds of messages (the last snapshot index)."""
        return len(self.snapshots) - 1

    def moves_at(self, step: int) -> list[Move]:
        return [m for m in self.moves if m.step == step]

    def contributors(self, step: int) -> list:
        """``[rank][chunk]``: sorted tuple of the ranks whose inputs are in that chunk after
        ``step`` (``None`` where the chunk holds nothing meaningful). Replays the moves:
        a reduce unites the two sets, a copy replaces; sources are read before the step."""
        n = self.world_size
        if self.separate_output:  # the output starts empty; inputs are read by from_input
            state = [[None] * len(self.snapshots[0][r]) for r in range(n)]
        else:
            state = [[(r,) if c is not None else None for c in self.snapshots[0][r]]
                     for r in range(n)]
        for s in range(1, step + 1):
            new = [list(row) for row in state]
            for m in self.moves_at(s):
                got = (m.src,) if m.from_input else state[m.src][m.src_chunk]
                if m.kind == "reduce":
                    got = tuple(sorted(set(new[m.dst][m.chunk] or ()) | set(got or ())))
                new[m.dst][m.chunk] = got
            state = [[v if self.snapshots[s][r][c] is not None else None
                      for c, v in enumerate(row)] for r, row in enumerate(new)]
        return state

    def describe(self, step: int) -> list[str]:
        """One line per move of ``step``, e.g. ``rank 0 → rank 1: chunk 3 reduce [12]``."""
        lines = []
        for m in self.moves_at(step):
            where = (f"chunk {m.src_chunk} → chunk {m.chunk}" if m.src_chunk != m.chunk
                     else f"chunk {m.chunk}")
            vals = "" if m.values is None else " = " + _short(m.values)
            lines.append(f"rank {m.src} → rank {m.dst}: {where} {m.kind}{vals}")
        return lines


def _short(vals, k: int = 6) -> str:
    text = ", ".join(_num(v) for v in vals[:k])
    return f"[{text}{', …' if len(vals) > k else ''}]"


def _num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def merge(per_rank: Sequence[dict], op: str, algorithm: str) -> Recording:
    """Combine the ranks' :meth:`Recorder.to_data` dicts (in rank order) into a Recording.

    Raises:
        ValueError: the ranks recorded different numbers of steps or chunks.
    """
    if not per_rank:
        raise ValueError("no per-rank records to merge")
    steps = {len(d["snapshots"]) for d in per_rank}
    chunks = {len(d["snapshots"][0]) if d["snapshots"] else 0 for d in per_rank}
    if len(steps) != 1 or len(chunks) != 1:
        raise ValueError(f"ranks disagree on the shape of the record: steps {sorted(steps)}, "
                         f"chunks {sorted(chunks)}")
    n_steps = steps.pop()
    snapshots = [[d["snapshots"][s] for d in per_rank] for s in range(n_steps)]
    phases = [next((d["phases"][s] for d in per_rank if d["phases"][s]), "")
              for s in range(n_steps)]
    moves = sorted((m for d in per_rank for m in d["moves"]),
                   key=lambda m: (m.step, m.dst, m.chunk))
    return Recording(op, algorithm, len(per_rank), chunks.pop(), [d["inputs"] for d in per_rank],
                     snapshots, phases, moves, bool(per_rank[0]["separate_output"]))


def record_native(rec: Recorder, op: str, x, out, n: int, me: int, k: int) -> None:
    """Record a native (torch.distributed) run, which has no visible steps: step 0 holds
    the input ``x``, step 1 the output ``out`` (``None`` on a reduce's non-root), each cut
    into ``k`` chunks the way the hand-built algorithm of ``op`` cuts them."""
    if op == "all_gather":
        mine = [x if i == me else None for i in range(n)]
        rec.inputs(mine)
        rec.end_step(0, mine, "start")
    else:
        rec.inputs(chunks_of(x, k), separate_output=op == "all_to_all")
        rec.end_step(0, [None] * k if op == "all_to_all" else chunks_of(x, k), "start")
    if out is None:
        cells = [None] * k
    elif op == "reduce_scatter":
        cells = [out if i == me else None for i in range(n)]
    else:
        cells = chunks_of(out, k)
    rec.end_step(1, cells, "native (inside torch.distributed)")
