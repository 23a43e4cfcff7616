"""Pipeline schedules as data: pure generators of per-rank action lists.

A schedule for ``P`` ranks, ``M`` microbatches and ``V`` stages per rank (``P·V`` stages in
all) is, for each rank, the ordered list of :class:`Action` it runs in one pipeline flush.
The same list feeds three consumers: :func:`labkit.parallel.pipeline.simulate.simulate`
(costs → timeline, bubble, memory), the executor (real model, real send/recv) and the
widget (Gantt chart).

Action kinds: ``F`` forward; ``BW`` full backward (input and weight gradients in one pass);
``B`` input-gradient backward and ``W`` weight-gradient backward (the zero-bubble split);
``SEND_F``/``RECV_F`` an activation and ``SEND_B``/``RECV_B`` a gradient crossing ranks
(added by :func:`with_comms`). String form ``{stage}{kind}{microbatch}``: ``1F0``, ``2B3``,
``0W1``, ``3BW2``, ``1SEND_F0``.

Sources: GPipe — Huang et al. 2019; 1F1B — Narayanan et al. 2019 (PipeDream-Flush) and
Narayanan et al. 2021 (Megatron-LM) §2.2.1; interleaved 1F1B — Narayanan et al. 2021
§2.2.2; ZB-H1 and ZB-V — Qi et al. 2023, "Zero Bubble Pipeline Parallelism" §3 and §6;
DualPipeV — DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" §3.2.1 (DualPipe), in the V
form of deepseek-ai/DualPipe and ``torch.distributed.pipelining.ScheduleDualPipeV``.

The builders live by how they run backward: :mod:`.full_backward` (GPipe, 1F1B,
interleaved: one ``BW`` pass) and :mod:`.zero_bubble` (ZB-H1, ZB-V, DualPipeV: ``B`` and
``W``); all are importable from here. This module holds the registry (:data:`SCHEDULES`,
:func:`build`) and the lowering to messages (:func:`with_comms`).
"""
from __future__ import annotations

from typing import Callable, Optional

from .actions import COMM_KINDS, COMPUTE_KINDS, Action, Schedule
# the builders, by how they run backward (importable from here as before)
from .full_backward import gpipe, interleaved_1f1b, one_f_one_b
from .zero_bubble import dualpipe_v, zb_h1, zb_v

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_v",
           "dualpipe_v", "build", "SCHEDULES", "STAGES_PER_RANK", "with_comms", "COMPUTE_KINDS", "COMM_KINDS"]


#: schedule name → ``builder(p, m, v)``
SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v=1: gpipe(p, m),
    "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
    "interleaved": lambda p, m, v=2: interleaved_1f1b(p, m, v),
    "zb-h1": lambda p, m, v=1: zb_h1(p, m),
    "zb-v": lambda p, m, v=2: zb_v(p, m),
    "dualpipe-v": lambda p, m, v=2: dualpipe_v(p, m),
}
#: stages per rank each schedule requires (``None``: any ``V >= 2``)
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": None, "zb-h1": 1, "zb-v": 2,
                   "dualpipe-v": 2}


def build(name: str, p: int, m: int, v: Optional[int] = None) -> Schedule:
    """The named schedule. ``v`` defaults to what the schedule needs (2 for interleaved).

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones), or a ``v`` the
            schedule cannot use.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    need = STAGES_PER_RANK[name]
    if v is None:
        v = need or 2
    if need is not None and v != need:
        raise ValueError(f"schedule {name!r} uses {need} stage(s) per rank, got "
                         f"virtual_stages={v}")
    return SCHEDULES[name](p, m, v)


def with_comms(sched: Schedule, prefetch: int = 0, early: bool = False) -> Schedule:
    """Lower a compute-only schedule: add a ``RECV_F``/``RECV_B`` before the compute that
    needs data from another rank and a ``SEND_F``/``SEND_B`` right after the compute that
    produces it. Edges between two stages of one rank need no message.

    A receive goes ``prefetch`` compute actions before the one that needs it; with
    ``early`` it goes earlier where the schedule allows: right after the consumer's last
    action that ends before the producing action starts, in the schedule's unit-cost
    timeline (:func:`~.simulate.simulate`). So the receive is already posted when the
    producer sends — on gloo, whose transfers start once both ends are posted, the sender
    then writes at once instead of waiting for its peer's "ready" — while at most the
    messages of about one action per peer are posted ahead (bounded buffer memory).
    """
    n = sched.n_stages
    end = start = {}
    if early:
        from .simulate import simulate  # the simulator imports this module

        spans = simulate(sched).spans
        start = {(sp.action.kind, sp.action.stage, sp.action.microbatch): sp.start
                 for sp in spans}
        end = {(sp.action.kind, sp.action.stage, sp.action.microbatch): sp.end
               for sp in spans}
        for (kind, s, i), t in list(start.items()):
            if kind == "BW":
                start[("B", s, i)] = t
    out = []
    for r, acts in enumerate(sched.actions):
        comp = [a for a in acts if a.is_compute]
        recvs: list = [[] for _ in comp]

        def slot(k: int, producer: tuple) -> int:
            at = max(0, k - prefetch)
            if early:
                t = start[producer]
                ended = [j for j in range(k) if end[(comp[j].kind, comp[j].stage,
                                                     comp[j].microbatch)] <= t]
                at = min(at, ended[-1] + 1 if ended else 0)
            return at

        for k, a in enumerate(comp):
            s, i = a.stage, a.microbatch
            if a.kind == "F" and s > 0 and sched.stage_rank(s - 1) != r:
                recvs[slot(k, ("F", s - 1, i))].append(Action(s, "RECV_F", i))
            if a.kind in ("B", "BW") and s < n - 1 and sched.stage_rank(s + 1) != r:
                recvs[slot(k, ("B", s + 1, i))].append(Action(s, "RECV_B", i))
        seq = []
        for k, a in enumerate(comp):
            s, i = a.stage, a.microbatch
            seq += recvs[k]
            seq.append(a)
            if a.kind == "F" and s < n - 1 and sched.stage_rank(s + 1) != r:
                seq.append(Action(s, "SEND_F", i))
            if a.kind in ("B", "BW") and s > 0 and sched.stage_rank(s - 1) != r:
                seq.append(Action(s, "SEND_B", i))
        out.append(tuple(seq))
    return Schedule(sched.name, sched.pp, sched.microbatches, sched.virtual, sched.style,
                    tuple(out), sched.warmup)
