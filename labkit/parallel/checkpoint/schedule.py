"""Activation checkpointing as data: schedules, closed-form counts, a pure simulator (C17).

A chain of ``N`` layers maps ``A_0 → A_1 → … → A_N``; layer ``i`` computes
``A_i = F_i(A_{i-1})`` and its backward ``G_{i-1} = F_i←(A_{i-1}, G_i)`` needs what the forward
saved. A *schedule* is the list of actions that trains the chain once:

====================  ===========================================================
``F3`` / ``R3``       forward (first time) / recompute layer 3 from ``A_2``;
                      suffix ``*``: build its autograd graph (keep what backward needs),
                      suffix ``+``: hold the output ``A_3`` as a checkpoint
``R3e``               selective: recompute only layer 3's element-wise part
``B3``                backward through layer 3 (frees what its graph saved)
``D3``                free the checkpoint ``A_3``
====================  ===========================================================

The same list has three consumers (DESIGN.md, "Schedules are data"): :func:`simulate` checks
it and counts without torch, :func:`labkit.parallel.checkpoint.exec.run_schedule` runs it on a
real layer stack and *measures* the counts, and ``labkit_widgets.CheckpointView`` draws it.

**Units.** Each chain layer is ``A_i = silu(A_{i-1}) @ W_i`` on ``(B, H)`` tensors. Its autograd
graph saves two ``(B, H)`` tensors: its input ``A_{i-1}`` (for ``silu'``) and ``s_i =
silu(A_{i-1})`` (for the weight gradient). One *unit* = one ``(B, H)`` tensor = ``B·H·4`` bytes
(fp32). A held checkpoint and a graph that saved the same tensor share storage and count once.
The input ``A_0`` is held from the start, like any checkpoint.

**Strategies** (lecture: CS231N 2026 lecture 11, the checkpointing animation; Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost"; Griewank & Walther 2000, "Algorithm 799:
revolve"; Korthikanti et al. 2022 §5 for selective). Closed forms, exact for every ``N ≥ 1``
(layer calls = first forwards + recomputes; peak in units):

==============  =============================================  ==============================
strategy        layer forward calls                            peak stored units
==============  =============================================  ==============================
none            ``N``                                          ``2N``
full            ``N(N+1)/2``                                   ``3`` (``2`` if ``N = 1``)
every C         ``N + q·C(C+1)/2 + r(r+1)/2``,                 ``⌈(N−1)/C⌉ + 2``
                ``(q, r) = divmod(N−1, C)``
sqrt            every C with ``C = ⌈√N⌉``                      every C with ``C = ⌈√N⌉``
segment C       ``2N − L``, ``L = N − C·⌊(N−1)/C⌋``            ``2N`` if ``C = N``, else
                (last segment, not recomputed)                 ``⌈N/C⌉ − 2 + 2C + [C | N]``
selective       ``N`` (+ ``N`` element-wise recomputes)        ``N + 1``
==============  =============================================  ==============================

"every C" recomputes each layer's input from the nearest checkpoint below it (checkpoints
every ``C`` layers): ``O(N·C)`` compute, ``O(N/C)`` memory. The lecture's table counts ``C``
as the *number* of checkpoints, ``k = N/C``: ``O(N²/k)`` compute, ``O(k)`` memory — the
same scheme. "segment" is what ``torch.utils.checkpoint`` (``checkpoint_sequential``) does:
each segment recomputed once with its graph kept, ``O(N)`` compute and ``O(N/C + C)`` memory,
``O(√N)`` at ``C = √N`` (Chen et al. 2016 §4.1).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["STRATEGIES", "BIG_O", "Action", "Schedule", "Counts", "SimStep", "SimResult",
           "make_schedule", "formula_counts", "simulate", "sqrt_every", "check_every"]

STRATEGIES = ("none", "full", "every", "sqrt", "segment", "selective")

#: The lectures' O() column: (compute, memory). "every" reads C as layers per checkpoint.
BIG_O = {"none": ("O(N)", "O(N)"), "full": ("O(N²)", "O(1)"),
         "every": ("O(N·C) = O(N²/k), k = N/C checkpoints", "O(N/C) = O(k)"),
         "sqrt": ("O(N√N)", "O(√N)"), "segment": ("O(N)", "O(N/C + C)"),
         "selective": ("O(N) (+ element-wise)", "O(N), half of none here")}

_OPS = {"F": "forward", "R": "recompute", "B": "backward", "D": "free"}
_CODE = {v: k for k, v in _OPS.items()}
_RE = re.compile(r"^([FRBD])(\d+)(e?)([*]?)([+]?)$")


@dataclass(frozen=True)
class Action:
    """One step of a schedule.

    Attributes:
        op: ``"forward"``, ``"recompute"``, ``"backward"`` or ``"free"``.
        layer: ``1..N`` for forward/recompute/backward; the activation index ``0..N−1`` for free.
        grad: forward/recompute: build the autograd graph (what backward needs stays saved).
        keep: forward/recompute: hold the output ``A_layer`` as a checkpoint.
        part: ``"layer"``, or ``"ew"`` for a selective recompute of the element-wise part.
    """

    op: str
    layer: int
    grad: bool = False
    keep: bool = False
    part: str = "layer"

    def __str__(self) -> str:
        return (f"{_CODE[self.op]}{self.layer}{'e' if self.part == 'ew' else ''}"
                f"{'*' if self.grad else ''}{'+' if self.keep else ''}")

    @classmethod
    def parse(cls, code: str) -> "Action":
        """``Action.parse("R3*")`` → recompute layer 3 with its graph. Raises ``ValueError``."""
        m = _RE.match(code.strip())
        if not m:
            raise ValueError(f"not an action code: {code!r} (e.g. 'F3*', 'R2', 'R4e', 'B3', 'D0')")
        op, layer, ew, grad, keep = m.groups()
        return cls(_OPS[op], int(layer), bool(grad), bool(keep), "ew" if ew else "layer")


@dataclass(frozen=True)
class Schedule:
    """A strategy's actions for ``n_layers`` (``every``: layers per checkpoint or segment)."""

    strategy: str
    n_layers: int
    every: Optional[int]
    actions: tuple

    @property
    def selective(self) -> bool:
        """Layers save only their input; the element-wise part is recomputed (``R·e``)."""
        return self.strategy == "selective"

    def codes(self) -> list[str]:
        return [str(a) for a in self.actions]

    def __str__(self) -> str:
        return " ".join(self.codes())


@dataclass(frozen=True)
class Counts:
    """Layer forward calls (first forwards + recomputes), element-wise recomputes, peak units."""

    forward: int
    recompute: int
    ew_recompute: int
    peak_units: int

    @property
    def layer_calls(self) -> int:
        return self.forward + self.recompute


def check_every(n_layers: int, every) -> int:
    """``every`` as an int in ``1..n_layers``; ``ValueError`` naming both numbers otherwise."""
    if isinstance(n_layers, bool) or int(n_layers) != n_layers or n_layers < 1:
        raise ValueError(f"n_layers must be a positive integer, got {n_layers!r}")
    if every is None or isinstance(every, bool) or int(every) != every:
        raise ValueError(f"C (layers per checkpoint) must be an integer, got {every!r}")
    if not 1 <= every <= n_layers:
        raise ValueError(f"C must satisfy 1 <= C <= N: got C={every} with N={n_layers} layers")
    return int(every)


def sqrt_every(n_layers: int) -> int:
    """``⌈√N⌉`` layers per checkpoint: about √N checkpoints of about √N layers each."""
    return math.isqrt(n_layers - 1) + 1


def _strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown checkpoint strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return strategy


def _resolve(strategy: str, n: int, every) -> Optional[int]:
    _strategy(strategy)
    check_every(n, 1)  # validates n
    if strategy in ("every", "segment"):
        return check_every(n, every)
    if strategy == "sqrt":
        return sqrt_every(n)
    if strategy == "full":
        return n
    return None


def make_schedule(strategy: str, n_layers: int, every: Optional[int] = None) -> Schedule:
    """The action list of ``strategy`` for a chain of ``n_layers``.

    Args:
        strategy: one of :data:`STRATEGIES`.
        n_layers: ``N >= 1``.
        every: ``C``, layers per checkpoint (``"every"``) or per segment (``"segment"``);
            ignored by the others (``"sqrt"`` uses ``⌈√N⌉``, ``"full"`` uses ``N``).

    Raises:
        ValueError: unknown strategy, ``N < 1``, or ``C < 1`` / ``C > N`` (message has both).
    """
    n, c = n_layers, _resolve(strategy, n_layers, every)
    F, R, B, D = (lambda i, **k: Action("forward", i, **k)), \
        (lambda i, **k: Action("recompute", i, **k)), (lambda i: Action("backward", i)), \
        (lambda j: Action("free", j))
    acts: list = []
    if strategy in ("none", "selective"):
        acts += [F(i, grad=True) for i in range(1, n + 1)]
        for i in range(n, 0, -1):
            if strategy == "selective":
                acts.append(R(i, part="ew"))
            acts.append(B(i))
        acts.append(D(0))
    elif strategy in ("full", "every", "sqrt"):
        acts += [F(i, keep=(i % c == 0 and i < n)) for i in range(1, n)] + [F(n, grad=True)]
        acts.append(B(n))
        if (n - 1) % c == 0:                          # A_{N-1} was a checkpoint: done with it
            acts.append(D(n - 1))
        for i in range(n - 1, 0, -1):
            base = c * ((i - 1) // c)                 # nearest checkpoint at or below A_{i-1}
            acts += [R(j) for j in range(base + 1, i)] + [R(i, grad=True), B(i)]
            if i - 1 == base:
                acts.append(D(base))
    else:  # segment
        start_last = c * ((n - 1) // c)               # first activation of the last segment
        for i in range(1, n + 1):
            acts.append(F(i, grad=i > start_last, keep=(i % c == 0 and i <= start_last
                                                         and i < n)))
        acts += [B(i) for i in range(n, start_last, -1)] + [D(start_last)]
        for s in range(start_last - c, -1, -c):
            acts += [R(i, grad=True) for i in range(s + 1, s + c + 1)]
            acts += [B(i) for i in range(s + c, s, -1)] + [D(s)]
    return Schedule(strategy, n, c, tuple(acts))


def formula_counts(strategy: str, n_layers: int, every: Optional[int] = None) -> Counts:
    """The closed forms of the module docstring (same arguments and errors as
    :func:`make_schedule`)."""
    n, c = n_layers, _resolve(strategy, n_layers, every)
    if strategy == "none":
        return Counts(n, 0, 0, 2 * n)
    if strategy == "selective":
        return Counts(n, 0, n, n + 1)
    if strategy in ("full", "every", "sqrt"):
        q, r = divmod(n - 1, c)
        rec = q * c * (c + 1) // 2 + r * (r + 1) // 2
        return Counts(n, rec, 0, -(-(n - 1) // c) + 2)
    last = n - c * ((n - 1) // c)
    k = -(-n // c)
    peak = 2 * n if k == 1 else k - 2 + 2 * c + (n % c == 0)
    return Counts(n, n - last, 0, peak)


@dataclass(frozen=True)
class SimStep:
    """State after one action: alive units (``"A3"`` activation, ``"s4"`` layer-4 internal)."""

    action: str
    alive: tuple
    units: int


@dataclass
class SimResult:
    schedule: Schedule
    steps: list = field(default_factory=list)
    counts: Optional[Counts] = None


def simulate(schedule: Schedule) -> SimResult:
    """Check ``schedule`` without torch and count what it does (units as in the docstring).

    Raises:
        ValueError: an action whose input is not available (e.g. a backward before the
            layer's graph exists, a forward whose input was neither held nor just computed),
            or a schedule that does not finish the backward to layer 1.
    """
    n, sel = schedule.n_layers, schedule.selective
    held, graphs, ew, grad_at, current = {0}, {}, set(), n, None
    fwd = rec = ew_rec = peak = 0
    out = SimResult(schedule)
    for k, a in enumerate(schedule.actions):
        where = f"action {k} ({a})"
        if a.op in ("forward", "recompute") and a.part == "layer":
            if not 1 <= a.layer <= n or (a.layer - 1 not in held and current != a.layer - 1):
                raise ValueError(f"{where}: input A_{a.layer - 1} is not available")
            current = a.layer
            if a.grad:
                graphs[a.layer] = {f"A{a.layer - 1}"} | (set() if sel else {f"s{a.layer}"})
            if a.keep:
                held.add(a.layer)
            fwd, rec = fwd + (a.op == "forward"), rec + (a.op == "recompute")
        elif a.op == "recompute":  # element-wise part
            if a.layer not in graphs:
                raise ValueError(f"{where}: layer {a.layer} has no saved input to recompute from")
            ew.add(a.layer)
            ew_rec += 1
        elif a.op == "backward":
            if a.layer not in graphs or grad_at != a.layer or (sel and a.layer not in ew):
                raise ValueError(f"{where}: layer {a.layer} is not ready for backward "
                                 f"(graph {'kept' if a.layer in graphs else 'missing'}, "
                                 f"gradient available at layer {grad_at})")
            del graphs[a.layer]
            ew.discard(a.layer)
            grad_at = a.layer - 1
        else:
            if a.layer not in held:
                raise ValueError(f"{where}: A_{a.layer} is not held")
            held.discard(a.layer)
        alive = {f"A{j}" for j in held} | {f"s{i}" for i in ew}
        for units in graphs.values():
            alive |= units
        peak = max(peak, len(alive))
        out.steps.append(SimStep(str(a), tuple(sorted(alive, key=_unit_key)), len(alive)))
    if grad_at != 0 or graphs:
        raise ValueError(f"schedule ends with the gradient at layer {grad_at}, not at the input")
    out.counts = Counts(fwd, rec, ew_rec, peak)
    return out


def _unit_key(label: str) -> tuple:
    return (int(label[1:]), label[0])
