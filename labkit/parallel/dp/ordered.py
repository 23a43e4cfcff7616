"""One order for a wrapper's collectives on every rank, whatever order autograd runs in.

Collectives on one process group are paired by their position in each rank's sequence of
calls: gloo tags every operation with a per-group counter, NCCL runs them in launch order
on one communicator. A wrapper that launches a bucket's all-reduce the moment autograd
finishes that bucket's gradients therefore pairs bucket 0 of one rank with bucket 1 of
another when the two ranks' backward passes run in different orders (a rank-dependent
branch, a data-dependent route). Equal sizes make it silent: nothing fails, the numbers are
wrong. PyTorch DDP's rule is the cure: "all processes must use the same bucketing order,
and no process can launch AllReduce on bucket i+1 before embarking bucket i" (Li et al.
2020, "PyTorch Distributed", §3.2.3).

:class:`CollectiveProgram` is that rule for a whole round (one backward, one forward): its
operations are listed once in a canonical order, and every rank issues them in that order
only. Two kinds:

* **push** operations (a gradient's all-reduce or reduce-scatter) are issued once they are
  ready *and* every earlier operation has been issued — a ready bucket waits for the
  earlier ones;
* **pull** operations (a unit's all-gather) are issued when the computation needs them or
  a prefetch asks, together with every earlier operation not yet issued.

A pull that meets an unready push before it cannot be served without changing the order:
this rank needs parameters whose place is after a gradient it has not produced yet. It
raises :class:`OrderError` (an error on one rank ends the job) rather than hang or mix
units.

:func:`grad_stamp` identifies a gradient tensor and its in-place version, so a wrapper can
tell whether a gradient changed after it was sent (another microbatch accumulated, or a
pass wrote ``.grad`` without any autograd hook firing); :func:`at_end_of_backward` runs a
function when the current backward pass ends (the engine's final callback, as PyTorch's
DDP and FSDP use).
"""
from __future__ import annotations

import weakref
from typing import Callable, Hashable, Iterable, Optional

import torch

__all__ = ["CollectiveProgram", "OrderError", "backward_program", "grad_stamp",
           "same_stamp", "at_end_of_backward"]


class OrderError(RuntimeError):
    """This rank needs a collective whose canonical place is after one it cannot issue yet."""


class CollectiveProgram:
    """Issue ``ops`` (hashable keys) through ``issue(key)`` in list order, on every rank.

    Args:
        ops: the round's operations in canonical order (the same list on every rank).
        issue: called once per operation, in order, to launch it (async).
        pull: the keys that are pulled (issued on demand) rather than pushed when ready.
        describe: ``key -> str`` for error messages.
    """

    def __init__(self, ops: Iterable[Hashable], issue: Callable, pull: Iterable = (),
                 describe: Callable = str):
        self.ops = list(ops)
        self._pos = {k: i for i, k in enumerate(self.ops)}
        if len(self._pos) != len(self.ops):
            raise ValueError("CollectiveProgram: an operation is listed twice")
        self._pull, self._issue, self._describe = set(pull), issue, describe
        self._ready: set = set()
        self.pc = 0  # operations issued so far

    def __contains__(self, key) -> bool:
        return key in self._pos

    def issued(self, key) -> bool:
        return self._pos[key] < self.pc

    @property
    def done(self) -> bool:
        return self.pc == len(self.ops)

    def mark_ready(self, key) -> None:
        """A push operation can go; issue it (and the ready ones after it) if its turn came."""
        self._ready.add(key)
        self._advance()

    def pull(self, key, force: bool = True) -> bool:
        """Issue everything up to and including ``key``.

        With ``force`` False (a prefetch) stop, returning False, at an unready push.

        Raises:
            OrderError: ``force`` and an unready push comes before ``key``.
        """
        target = self._pos[key]
        while self.pc <= target:
            op = self.ops[self.pc]
            if op not in self._pull and op not in self._ready:
                if not force:
                    return False
                raise OrderError(
                    f"this rank needs {self._describe(key)} before {self._describe(op)} is "
                    f"ready, but every rank must issue the collectives in the canonical order "
                    f"{[self._describe(o) for o in self.ops]}: the ranks' orders differ by "
                    f"more than adjacent units. Run the units in the same order on every "
                    f"rank.")
            self._step()
        self._advance()
        return True

    def prefetch_after(self, key) -> None:
        """Issue the next pull operation after ``key`` if nothing unready stands before it."""
        for op in self.ops[self._pos[key] + 1:]:
            if op in self._pull:
                if not self.issued(op):
                    self.pull(op, force=False)
                return

    def flush(self) -> None:
        """Issue every remaining operation in order, ready or not (the end of a round:
        ``issue`` sends what there is, e.g. zeros for a gradient that never came)."""
        while self.pc < len(self.ops):
            self._step()

    def _advance(self) -> None:
        while self.pc < len(self.ops) and self.ops[self.pc] in self._ready:
            self._step()

    def _step(self) -> None:
        op = self.ops[self.pc]
        self.pc += 1  # before issuing: ``issue`` may look at the program
        self._issue(op)


def backward_program(gather_order: list, reduce_order: list) -> list:
    """ZeRO-3's backward round as one sequence: ``("ag", u)`` for ``gather_order`` with
    each ``("rs", u)`` of ``reduce_order`` placed right after the all-gather of the unit
    that follows ``u`` in ``gather_order`` (never before the reduce-scatters listed before
    it; units absent from ``gather_order`` go last).

    That is the order a rank prefetching one unit ahead produces anyway — gather the next
    unit, then send the gradient just finished — and it stays servable when two ranks
    swap adjacent units: a rank that needs unit ``i+1`` before unit ``i``'s gradient can
    still issue both all-gathers first. Example, gathers ``[root, L1, L0]``, reduces
    ``[L1, L0, root]``: ``ag root, ag L1, ag L0, rs L1, rs L0, rs root``.
    """
    n = len(gather_order)
    pos = {u: j for j, u in enumerate(gather_order)}
    after, last = [], 0
    for u in reduce_order:
        last = max(last, min(pos[u] + 1, n - 1) if u in pos else n - 1)
        after.append(last)
    ops = []
    for j, g in enumerate(gather_order):
        ops.append(("ag", g))
        ops.extend(("rs", u) for u, k in zip(reduce_order, after) if k == j)
    if not gather_order:
        ops.extend(("rs", u) for u in reduce_order)
    return ops


def grad_stamp(t: Optional[torch.Tensor]):
    """``(weak reference, version)`` of a gradient tensor (``None`` for no gradient)."""
    return None if t is None else (weakref.ref(t), t._version)


def same_stamp(stamp, t: Optional[torch.Tensor]) -> bool:
    """Is ``t`` the very tensor of ``stamp``, unmodified in place since?"""
    if stamp is None or t is None:
        return stamp is None and t is None
    return stamp[0]() is t and t._version == stamp[1]


def at_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass now running has finished (call from a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
