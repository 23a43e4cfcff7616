"""Running checkpoint schedules for real, and checkpoint policies for the GPT.

* :class:`SavedTensorTracker` counts the bytes autograd keeps for backward, through
  ``torch.autograd.graph.saved_tensors_hooks``: one count per distinct storage (a tensor saved
  by two ops, or saved and also held as a checkpoint, counts once); parameters and buffers of
  the model are not activations and are left out.
* :func:`run_schedule` executes a :class:`~labkit.parallel.checkpoint.Schedule` on a
  :class:`ChainStack` and *measures* the two counts the formulas predict: layer forward calls
  (counted inside the layers) and peak stored activation bytes (saved tensors + checkpoints).

The checkpoint policies for the real GPT live in :mod:`labkit.parallel.checkpoint.policy`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .schedule import Counts, Schedule

__all__ = ["SavedTensorTracker", "ChainLayer", "ChainStack", "ExecResult", "ExecStep",
           "run_schedule"]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release callback when dropped."""

    __slots__ = ("t", "ptr", "tracker")

    def __init__(self, tracker, ptr, t):
        self.tracker, self.ptr, self.t = tracker, ptr, t

    def __del__(self):
        self.tracker._drop(self.ptr)


class SavedTensorTracker:
    """Live bytes of saved activations (and of tensors :meth:`hold` s), peak included.

    Args:
        exclude: modules (their parameters and buffers) or tensors that are not activations.

    Attributes:
        current: bytes alive now; ``peak``: the largest ``current`` seen (bytes).
        context: label for new storages saved while it is set (e.g. ``"s3"``); storages named
            with :meth:`name` keep that name.
    """

    def __init__(self, exclude=()):
        self._excluded: set = set()
        for obj in exclude:
            tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(
                obj, nn.Module) else [obj]
            self._excluded.update(_ptr(t) for t in tensors)
        self._live: dict = {}     # ptr -> [refcount, nbytes, label]
        self._names: dict = {}
        self.current = self.peak = 0
        self.context = "?"

    def expect(self, t: torch.Tensor, label: str) -> None:
        """Label ``t``'s storage (for :meth:`alive`) if it is saved or held next; replaces the
        previous expectation, so a freed address reused later is not misnamed."""
        self._names = {_ptr(t): label}

    def _add(self, t: torch.Tensor) -> Optional[int]:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if ptr in self._excluded or nbytes == 0:
            return None
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [1, nbytes, self._names.get(ptr, self.context)]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return ptr

    def _drop(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[ptr]

    def _pack(self, t):
        ptr = self._add(t)
        return t if ptr is None else _Saved(self, ptr, t)

    @staticmethod
    def _unpack(obj):
        return obj.t if isinstance(obj, _Saved) else obj

    def hooks(self):
        """``with tracker.hooks(): ...`` — count what autograd saves inside."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def hold(self, t: torch.Tensor) -> Optional[_Saved]:
        """Count ``t`` as stored until the returned token is dropped (a checkpoint)."""
        ptr = self._add(t)
        return None if ptr is None else _Saved(self, ptr, t)

    def alive(self) -> tuple:
        """Labels of the storages alive now, sorted by layer."""
        return tuple(sorted((e[2] for e in self._live.values()),
                            key=lambda s: (int(s[1:]) if s[1:].isdigit() else -1, s[0])))


class _SiluMatmulKeepInput(torch.autograd.Function):
    """``silu(x) @ w`` saving only ``x``; backward takes ``silu(x)`` recomputed by the schedule
    (the ``R·e`` action) from ``box["s"]`` — selective recomputation of the element-wise part."""

    @staticmethod
    def forward(ctx, x, w, box):
        ctx.save_for_backward(x, w)
        ctx.box = box
        return F.silu(x) @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        s = ctx.box.pop("s")
        sig = torch.sigmoid(x)
        dx = (g @ w.t()) * sig * (1 + x * (1 - sig))
        return dx, s.t() @ g, None


class ChainLayer(nn.Module):
    """``A_i = silu(A_{i-1}) @ W``: ``(B, H)`` → ``(B, H)``, ``W`` ``(H, H)``; counts its calls."""

    def __init__(self, hidden: int, generator: Optional[torch.Generator] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden, generator=generator)
                                   / hidden ** 0.5)
        self.calls = 0
        self.ew_calls = 0

    def forward(self, x: torch.Tensor, box: Optional[dict] = None) -> torch.Tensor:
        self.calls += 1
        if box is not None:
            return _SiluMatmulKeepInput.apply(x, self.weight, box)
        return F.silu(x) @ self.weight

    def recompute_elementwise(self, x: torch.Tensor) -> torch.Tensor:
        self.ew_calls += 1
        return F.silu(x.detach())


class ChainStack(nn.ModuleList):
    """``n_layers`` :class:`ChainLayer` s of width ``hidden``, weights from ``seed``."""

    def __init__(self, n_layers: int, hidden: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        super().__init__(ChainLayer(hidden, g) for _ in range(n_layers))
        self.hidden = hidden

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self)

    @property
    def ew_calls(self) -> int:
        return sum(m.ew_calls for m in self)


@dataclass(frozen=True)
class ExecStep:
    """After one action: its code, the labels of stored tensors alive, their bytes."""

    action: str
    alive: tuple
    bytes: int


@dataclass
class ExecResult:
    """Measured counts of one schedule run (bytes; ``unit_bytes = B·H·4``)."""

    schedule: Schedule
    counts: Counts
    peak_bytes: int
    unit_bytes: int
    steps: list = field(default_factory=list)
    input_grad: Optional[torch.Tensor] = None
    weight_grads: list = field(default_factory=list)


def run_schedule(schedule: Schedule, batch: int = 2, hidden: int = 16, seed: int = 0,
                 stack: Optional[ChainStack] = None) -> ExecResult:
    """Run ``schedule`` on a real :class:`ChainStack` (built from ``seed`` unless given).

    The input ``A_0`` is ``(batch, hidden)`` fp32 noise and ``G_N`` (the gradient arriving at
    the output) is noise too; both from ``seed``. Stored activations are what the saved-tensor
    hooks see plus the checkpoints the schedule holds, one count per storage.

    Returns:
        :class:`ExecResult` with measured :class:`~labkit.parallel.checkpoint.Counts`
        (``peak_units = peak_bytes / unit_bytes``), per-step alive labels, and the gradients.

    Raises:
        ValueError: an action the state does not allow (the message names it).
    """
    n = schedule.n_layers
    stack = stack if stack is not None else ChainStack(n, hidden, seed)
    if len(stack) != n:
        raise ValueError(f"stack has {len(stack)} layers, schedule needs {n}")
    for m in stack:
        m.calls = m.ew_calls = 0
        m.weight.grad = None
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, stack.hidden, generator=gen)
    grad = torch.randn(batch, stack.hidden, generator=gen)
    tr = SavedTensorTracker(exclude=[stack])
    tr.expect(x, "A0")
    held, graphs, boxes = {0: (x, tr.hold(x))}, {}, {}
    current, grad_at, rec_calls, steps = (0, x), n, 0, []
    input_grad = None
    for k, a in enumerate(schedule.actions):
        i, where = a.layer, f"action {k} ({a})"
        if a.op in ("forward", "recompute") and a.part == "layer":
            src = held[i - 1][0] if i - 1 in held else current[1] if current[0] == i - 1 else None
            if src is None:
                raise ValueError(f"{where}: input A_{i - 1} is not available")
            before = stack.calls
            tr.context = f"s{i}"
            tr.expect(src, f"A{i - 1}")
            if a.grad:
                inp = src.detach().requires_grad_()
                box = {} if schedule.selective else None
                with tr.hooks():
                    out = stack[i - 1](inp, box)
                graphs[i] = (inp, out, box)
                new = out.detach()
            else:
                with torch.no_grad():
                    new = stack[i - 1](src)
            rec_calls += (stack.calls - before) if a.op == "recompute" else 0
            current = (i, new)
            if a.keep:
                tr.expect(new, f"A{i}")
                held[i] = (new, tr.hold(new))
        elif a.op == "recompute":
            if i not in graphs or graphs[i][2] is None:
                raise ValueError(f"{where}: layer {i} has no selective graph to recompute into")
            tr.context = f"s{i}"
            s = stack[i - 1].recompute_elementwise(graphs[i][0])
            graphs[i][2]["s"] = s
            boxes[i] = tr.hold(s)
        elif a.op == "backward":
            if i not in graphs or grad_at != i:
                raise ValueError(f"{where}: layer {i} is not ready for backward")
            inp, out, box = graphs.pop(i)
            torch.autograd.backward(out, grad)
            grad, grad_at = inp.grad, i - 1
            del inp, out, box
            boxes.pop(i, None)
        else:
            if i not in held:
                raise ValueError(f"{where}: A_{i} is not held")
            del held[i]
        if grad_at == 0 and input_grad is None:
            input_grad = grad
        steps.append(ExecStep(str(a), tr.alive(), tr.current))
    unit = batch * stack.hidden * 4
    first = stack.calls - rec_calls
    counts = Counts(first, rec_calls, stack.ew_calls, tr.peak // unit)
    return ExecResult(schedule, counts, tr.peak, unit, steps, input_grad,
                      [m.weight.grad for m in stack])
