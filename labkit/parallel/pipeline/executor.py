"""Run one rank's part of a pipeline schedule on real stage modules.

The executor walks the rank's lowered action list (:func:`~.schedules.with_comms`) in
order — the same list the simulator checked:

* ``RECV_F`` / ``RECV_B`` post a non-blocking receive (``labkit.comm.irecv``), a couple of
  compute actions ahead (``prefetch``); the compute that needs the tensor waits on it;
* ``F`` runs the stage (and, on the last stage, the loss scaled by ``loss_scale``);
* ``BW`` is ``torch.autograd.backward`` from the stage output with the received gradient;
  ``B`` is the same pass with :class:`~.stage.SplitLinear` layers, which leaves the weight
  gradients in the :class:`~.stage.WeightGradStore`; ``W`` computes them;
* ``SEND_F`` / ``SEND_B`` post a non-blocking send (``labkit.comm.isend``), waited for at
  the end of the flush.

Only receives ever block, and only on data the schedule says was produced earlier, so a
schedule the simulator accepts cannot deadlock here. Every message has a unique tag
(kind, stage, microbatch), so messages between two ranks can never be mismatched. Edges
between two stages of the same rank (interleaved with ``P = 1``, the turn of ZB-V) pass
the tensor locally. Each compute action is a traced region named ``F``, ``B``, ``W`` or
``BW`` with args ``stage``, ``microbatch`` and ``flush``.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ... import comm
from ...trace import region
from .schedules import Schedule, with_comms
from .stage import ActivationMeter, WeightGradStore

__all__ = ["PipelineExecutor", "message_tag"]


def message_tag(is_grad: bool, stage: int, microbatch: int, n_stages: int) -> int:
    """Unique tag of the activation sent *from* ``stage`` (or the gradient sent from it)."""
    return ((microbatch * n_stages + stage) * 2 + int(is_grad)) + 1


class PipelineExecutor:
    """One rank's executor.

    Args:
        schedule: the compute-only :class:`~.schedules.Schedule` (lowered here).
        stages: ``{stage: StageModule}`` for the stages this rank holds.
        rank: this rank's position in ``group`` (global rank on a labkit cluster).
        group: the pipeline process group.
        act_shape: ``(micro_batch, S, H)`` — every boundary tensor has this shape.
        store: the :class:`WeightGradStore` of the stages' split linears (zero-bubble).
        meter: an :class:`ActivationMeter` (optional).
        prefetch: post each receive this many compute actions before the one that needs
            it, so gloo's receive-ready handshake and the transfer overlap compute.
        pp_ranks: global rank of each pipeline rank (``pp_ranks[i]`` runs stage rank
            ``i``); default ``0 … P−1``. The one training job runs a pipeline per data and
            tensor coordinate, each over its own ranks.
        forward_fns: ``{stage: callable}`` that runs a stage's forward (a data-parallel
            wrapper around it); default the stage module itself.
        loss_reduction: ``"mean"`` or ``"sum"`` over a microbatch's tokens, before
            ``loss_scale`` (the one training job uses the sum over the global token count).
    """

    def __init__(self, schedule: Schedule, stages: dict, rank: int, group, act_shape: tuple,
                 dtype=torch.float32, device="cpu", store: Optional[WeightGradStore] = None,
                 meter: Optional[ActivationMeter] = None, prefetch: int = 2,
                 pp_ranks: Optional[tuple] = None, forward_fns: Optional[dict] = None,
                 loss_reduction: str = "mean"):
        self.sched, self.stages, self.rank, self.group = schedule, stages, rank, group
        self.pp_ranks = tuple(pp_ranks) if pp_ranks is not None else tuple(
            range(schedule.pp))
        self.forward_fns = forward_fns or {}
        self.loss_reduction = loss_reduction
        self.plan = with_comms(schedule, prefetch).actions[rank]
        self.act_shape, self.dtype, self.device = act_shape, dtype, device
        self.store, self.meter = store, meter
        self.n = schedule.n_stages
        missing = set(schedule.stages_of(rank)) - set(stages)
        if missing:
            raise ValueError(f"rank {rank} needs stages {sorted(missing)} for this schedule")

    def _tag(self, is_grad: bool, stage: int, mb: int) -> int:
        return message_tag(is_grad, stage, mb, self.n)

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.act_shape, dtype=self.dtype, device=self.device)

    def run(self, x: torch.Tensor, y: torch.Tensor, loss_scale: float, flush: int = 0) -> float:
        """One flush: ``x``, ``y`` int64 ``(M·b, S)`` (the ranks without the first or last
        stage may pass anything of that shape). Gradients accumulate into ``.grad``.

        Returns the sum over microbatches of ``loss_scale · loss`` on the rank holding the
        last stage (the flush's mean loss when ``loss_scale = 1/M``), else ``0.0``.
        """
        m = self.sched.microbatches
        b = x.shape[0] // m
        stage_rank, ranks = self.sched.stage_rank, self.pp_ranks

        def owner(stage: int) -> int:  # the global rank running ``stage``
            return ranks[stage_rank(stage)]

        me = ranks[self.rank]
        recvd, local_in, local_grad, grad_out = {}, {}, {}, {}
        inputs, outputs, sends, losses = {}, {}, [], []
        meter = self.meter
        for a in self.plan:
            kind, s, i = a.kind, a.stage, a.microbatch
            if kind == "RECV_F":
                buf = self._buffer()
                recvd[("F", s, i)] = (comm.irecv(buf, owner(s - 1), self.group, axis="pp",
                                                 tag=self._tag(False, s - 1, i)), buf)
            elif kind == "RECV_B":
                buf = self._buffer()
                recvd[("B", s, i)] = (comm.irecv(buf, owner(s + 1), self.group, axis="pp",
                                                 tag=self._tag(True, s + 1, i)), buf)
            elif kind == "F":
                stage = self.stages[s]
                if s == 0:
                    inp = x[i * b:(i + 1) * b]
                elif ("F", s, i) in recvd:
                    h, inp = recvd.pop(("F", s, i))
                    h.wait()
                    inp.requires_grad_()
                else:
                    inp = local_in.pop((s, i))
                with region("F", stage=s, microbatch=i, flush=flush):
                    ctx = meter.forward((s, i)) if meter is not None else contextlib.nullcontext()
                    with ctx:
                        out = self.forward_fns.get(s, stage)(inp)
                        if stage.is_last:
                            out = stage.loss(out, y[i * b:(i + 1) * b],
                                             self.loss_reduction) * loss_scale
                if stage.is_last:
                    losses.append(out.detach())
                elif owner(s + 1) == me:
                    local_in[(s + 1, i)] = out.detach().requires_grad_()
                inputs[(s, i)], outputs[(s, i)] = inp, out
            elif kind == "SEND_F":
                sends.append(comm.isend(outputs[(s, i)].detach(), owner(s + 1), self.group,
                                        axis="pp", tag=self._tag(False, s, i)))
            elif kind in ("B", "BW"):
                if s == self.n - 1:
                    grad = None
                elif ("B", s, i) in recvd:
                    h, grad = recvd.pop(("B", s, i))
                    h.wait()
                else:
                    grad = local_grad.pop((s, i))
                with region(kind, stage=s, microbatch=i, flush=flush):
                    if self.store is not None:
                        self.store.key = (s, i)
                    torch.autograd.backward(outputs.pop((s, i)), grad)
                inp = inputs.pop((s, i))
                if s > 0:
                    if owner(s - 1) == me:
                        local_grad[(s - 1, i)] = inp.grad
                    else:
                        grad_out[(s, i)] = inp.grad
                if kind == "BW" and meter is not None:
                    meter.release((s, i))
            elif kind == "SEND_B":
                sends.append(comm.isend(grad_out.pop((s, i)), owner(s - 1), self.group,
                                        axis="pp", tag=self._tag(True, s, i)))
            elif kind == "W":
                with region("W", stage=s, microbatch=i, flush=flush):
                    self.store.flush((s, i))
                if meter is not None:
                    meter.release((s, i))
        for h in sends:
            h.wait()
        return float(torch.stack(losses).sum()) if losses else 0.0

