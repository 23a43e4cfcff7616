"""Run one rank's part of a pipeline schedule on real stage modules.

The executor runs the rank's lowered action list (:func:`~.schedules.with_comms`) — the same
list the simulator checked — compiled once, at construction, into steps: one compute action
and the messages posted right after it. Per step:

* wait for the compute's input (a receive posted earlier), run it: ``F`` the stage (and on
  the last stage the loss scaled by ``loss_scale``); ``BW`` ``torch.autograd.backward`` from
  the stage output with the received gradient; ``B`` the same pass with
  :class:`~.stage.SplitLinear` layers, which leaves the weight gradients in the
  :class:`~.stage.WeightGradStore`; ``W`` computes them (a ``BW`` on split layers, as
  DualPipeV mixes them, computes them at once);
* then, as one batch, post the step's sends (``labkit.comm.isend``: the next rank is
  waiting for them, so they go first) and the receives of later steps
  (``labkit.comm.irecv``). Receives are posted as early as the schedule allows
  (``with_comms(..., early=True)``): before the producer sends, in the schedule's unit-cost
  timeline, so on gloo the sender writes at once instead of waiting for its peer's
  "ready". Sends are waited for at the end of the flush.

Only receives ever block, and only on data the schedule says was produced earlier, so a
schedule the simulator accepts cannot deadlock here. Every message has a unique tag
(kind, stage, microbatch), so messages between two ranks can never be mismatched. Edges
between two stages of the same rank (interleaved with ``P = 1``, the turn of ZB-V) pass
the tensor locally.

Peers are addressed by global rank through ``pp_ranks`` (stage-rank ``i`` → global rank),
so several pipelines (one per data/tensor coordinate of a mesh) run at once on one pool.

Each compute action is a traced ``compute`` event named ``F``, ``B``, ``W`` or ``BW`` with
args ``stage``, ``microbatch``, ``flush``, ``cpu_s`` (this thread's CPU seconds inside the
span: the work, which stays the same when ranks share cores while the wall span stretches)
and ``exec_cpu_s`` (CPU seconds the executor itself spent since the previous span: posting
messages and bookkeeping — its own time per action).
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional, Sequence

import torch

from ... import comm
from ...trace import COMPUTE, Event, current_tracer
from .actions import check_pp_ranks
from .schedules import Schedule, with_comms
from .stage import ActivationMeter, WeightGradStore

__all__ = ["PipelineExecutor", "message_tag", "check_pp_ranks"]


def message_tag(is_grad: bool, stage: int, microbatch: int, n_stages: int) -> int:
    """Unique tag of the activation sent *from* ``stage`` (or the gradient sent from it)."""
    return ((microbatch * n_stages + stage) * 2 + int(is_grad)) + 1


def _cpu_clock():
    """This thread's CPU clock when torch computes on it alone, else the process's."""
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


class PipelineExecutor:
    """One rank's executor.

    Args:
        schedule: the compute-only :class:`~.schedules.Schedule` (lowered here).
        stages: ``{stage: StageModule}`` for the stages this rank holds.
        rank: this rank's stage-rank: its position ``0 … P−1`` in the pipeline.
        group: the pipeline process group.
        act_shape: ``(micro_batch, S, H)`` — every boundary tensor has this shape.
        store: the :class:`WeightGradStore` of the stages' split linears (zero-bubble).
        meter: an :class:`ActivationMeter` (optional).
        prefetch: post each receive at least this many compute actions before the one
            that needs it (earlier where the schedule allows, see the module docstring).
        pp_ranks: global rank of each stage-rank (``pp_ranks[i]`` holds stage-rank ``i``);
            ``None`` = ``(0, 1, …, P−1)``, the pipeline on the pool's first ``P`` ranks.
            The one training job runs a pipeline per data and tensor coordinate, each over
            its own ranks.
        forward_fns: ``{stage: callable}`` that runs a stage's forward (a data-parallel
            wrapper around it); default the stage module itself.
        loss_reduction: ``"mean"`` or ``"sum"`` over a microbatch's tokens, before
            ``loss_scale`` (the one training job uses the sum over the global token count).

    Raises:
        ValueError: ``stages`` lacks a stage the schedule puts on ``rank``; ``rank`` not in
            ``0 … P−1``; a bad ``pp_ranks`` (:func:`check_pp_ranks`); ``loss_reduction``
            not ``"mean"`` or ``"sum"``.
    """

    def __init__(self, schedule: Schedule, stages: dict, rank: int, group, act_shape: tuple,
                 dtype=torch.float32, device="cpu", store: Optional[WeightGradStore] = None,
                 meter: Optional[ActivationMeter] = None, prefetch: int = 2,
                 pp_ranks: Optional[Sequence[int]] = None, forward_fns: Optional[dict] = None,
                 loss_reduction: str = "mean"):
        if not 0 <= rank < schedule.pp:
            raise ValueError(f"rank={rank} is not a stage-rank of a pipeline of "
                             f"pp={schedule.pp} ranks")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}: expected 'mean' or 'sum'")
        self.sched, self.stages, self.rank, self.group = schedule, stages, rank, group
        self.pp_ranks = check_pp_ranks(pp_ranks, schedule.pp)
        self.forward_fns = dict(forward_fns or {})
        self.loss_reduction = loss_reduction
        self.act_shape, self.dtype, self.device = act_shape, dtype, device
        self.store, self.meter = store, meter
        self.n = schedule.n_stages
        missing = set(schedule.stages_of(rank)) - set(stages)
        if missing:
            raise ValueError(f"rank {rank} needs stages {sorted(missing)} for this schedule")
        self.plan = with_comms(schedule, prefetch, early=True).actions[rank]
        self.first_posts, self.steps = self._compile(self.plan)
        self._sync = (torch.cuda.synchronize if torch.device(device).type == "cuda"
                      else None)

    def _compile(self, plan) -> tuple:
        """``(posts before the first compute, [(kind, stage, mb, posts after it)])``; a post
        is ``(is_send, key, global peer, tag)`` with ``key = (is_grad, stage, mb)``."""
        owner, peer, n = self.sched.stage_rank, self.pp_ranks, self.n
        first, steps = [], []
        for a in plan:
            s, i = a.stage, a.microbatch
            if a.is_compute:
                steps.append((a.kind, s, i, []))
                continue
            posts = steps[-1][3] if steps else first
            if a.kind == "RECV_F":
                posts.append((False, (False, s, i), peer[owner(s - 1)],
                              message_tag(False, s - 1, i, n)))
            elif a.kind == "RECV_B":
                posts.append((False, (True, s, i), peer[owner(s + 1)],
                              message_tag(True, s + 1, i, n)))
            elif a.kind == "SEND_F":
                posts.append((True, (False, s, i), peer[owner(s + 1)],
                              message_tag(False, s, i, n)))
            else:  # SEND_B
                posts.append((True, (True, s, i), peer[owner(s - 1)],
                              message_tag(True, s, i, n)))
        for _, _, _, posts in steps:  # sends first: a peer is waiting for them
            posts.sort(key=lambda p: not p[0])
        return first, steps

    def run(self, x: torch.Tensor, y: torch.Tensor, loss_scale: float,
            flush: int = 0) -> torch.Tensor:
        """One flush: ``x``, ``y`` int64 ``(M·b, S)`` (the ranks without the first or last
        stage may pass anything of that shape). Gradients accumulate into ``.grad``.

        Returns the sum over microbatches of ``loss_scale · loss`` on the rank holding the
        last stage (the flush's mean loss when ``loss_scale = 1/M``), else 0, as a 0-d
        float64 tensor on the stages' device (the host does not wait for it).
        """
        b = x.shape[0] // self.sched.microbatches
        owner, me, stages, meter = self.sched.stage_rank, self.rank, self.stages, self.meter
        pending: dict = {}   # (is_grad, stage, mb) -> (handle, buffer)
        ready: dict = {}     # (is_grad, stage, mb) -> tensor to send
        local_in, local_grad, inputs, outputs, sends, losses = {}, {}, {}, {}, [], []
        if meter is not None:
            meter.ignore(x, y)  # the batch is data, not activations
        tracer = current_tracer()
        if tracer is not None and not tracer.enabled:
            tracer = None
        clock = _cpu_clock()
        self._post(self.first_posts, pending, ready, sends)
        last_cpu = clock()
        for kind, s, i, posts in self.steps:
            stage = stages[s]
            if kind == "F":
                if s == 0:
                    inp = x[i * b:(i + 1) * b]
                elif (False, s, i) in pending:
                    h, inp = pending.pop((False, s, i))
                    h.wait()
                    inp.requires_grad_()
                else:
                    inp = local_in.pop((s, i))
            elif kind in ("B", "BW"):
                if s == self.n - 1:
                    grad = None
                elif (True, s, i) in pending:
                    h, grad = pending.pop((True, s, i))
                    h.wait()
                else:
                    grad = local_grad.pop((s, i))
            if tracer is not None:
                if self._sync is not None:
                    self._sync()
                t0, c0 = tracer.now(), clock()
            # the compute
            if kind == "F":
                with meter.forward((s, i)) if meter is not None else contextlib.nullcontext():
                    out = self.forward_fns.get(s, stage)(inp)
                    if stage.is_last:
                        out = stage.loss(out, y[i * b:(i + 1) * b],
                                         self.loss_reduction) * loss_scale
            elif kind == "W":
                self.store.flush((s, i))
            else:
                if self.store is not None:
                    self.store.key = (s, i)
                torch.autograd.backward(outputs.pop((s, i)), grad)
                if kind == "BW" and self.store is not None:
                    # a schedule that mixes full and split backwards (DualPipeV): the split
                    # linears deferred dW to the store; a full backward computes it now
                    self.store.flush((s, i))
            if tracer is not None:
                if self._sync is not None:
                    self._sync()
                c1 = clock()
                tracer.record(Event(tracer.rank, kind, COMPUTE, t0, tracer.now(), args={
                    "stage": s, "microbatch": i, "flush": flush, "cpu_s": c1 - c0,
                    "exec_cpu_s": c0 - last_cpu}))
                last_cpu = c1
            # what this step produced, then its messages (sends first)
            if kind == "F":
                if stage.is_last:
                    losses.append(out.detach())
                else:
                    if owner(s + 1) == me:
                        local_in[(s + 1, i)] = out.detach().requires_grad_()
                    else:
                        ready[(False, s, i)] = out.detach()
                inputs[(s, i)], outputs[(s, i)] = inp, out
            elif kind in ("B", "BW"):
                inp = inputs.pop((s, i))
                if s > 0:
                    if owner(s - 1) == me:
                        local_grad[(s - 1, i)] = inp.grad
                    else:
                        ready[(True, s, i)] = inp.grad
            if posts:
                self._post(posts, pending, ready, sends)
            # a stage output's graph holds its input (the leaf's AccumulateGrad): drop the
            # loop's references now, not when the next step rebinds them, or the previous
            # microbatch's input stays alive through the next forward
            inp = out = grad = h = None
        for h in sends:
            h.wait()
        # a 0-d float64 tensor, not a float: reading it would wait for the device
        return torch.stack(losses).sum().detach().double() if losses \
            else torch.zeros((), dtype=torch.float64, device=x.device)

    def _post(self, posts, pending: dict, ready: dict, sends: list) -> None:
        """Post one batch: the sends (``ready`` tensors), then the receives."""
        for is_send, key, peer, tag in posts:
            if is_send:
                sends.append(comm.isend(ready.pop(key), peer, self.group, axis="pp", tag=tag))
            else:
                buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                pending[key] = (comm.irecv(buf, peer, self.group, axis="pp", tag=tag), buf)
