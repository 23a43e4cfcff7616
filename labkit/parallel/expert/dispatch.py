"""The expert-parallel token dispatcher: counts, all-to-all out, local experts, all-to-all back.

With ``P`` ranks in the ``ep`` group and ``E`` experts, rank ``r`` holds experts
``[r·E/P, (r+1)·E/P)``. One MoE layer's forward on rank ``r`` (the scheme of GShard,
Lepikhin et al. 2020 §3.2, and of Megatron-Core's ``MoEAlltoAllTokenDispatcher``):

1. **Permute**: sort the kept ``(token, slot)`` choices by expert, so the rows bound for
   rank ``j`` are contiguous (experts of one rank are consecutive ids).
2. **Count exchange**: an all-to-all of the per-expert counts (``E`` int64): rank ``r``
   learns ``recv[j, l]``, the rows rank ``j`` sends to its local expert ``l``. Routing is
   data-dependent, so these sizes differ per step, per rank, and may be 0.
3. **Dispatch**: an all-to-all-v of the rows (``input_splits[j] = Σ_l counts[j·E/P + l]``,
   ``output_splits[j] = Σ_l recv[j, l]``).
4. **Local experts**: the received rows arrive source-major (rank 0's rows for each local
   expert, then rank 1's …); a stable sort by local expert groups them, each expert runs on
   its rows, and the inverse permutation restores the source-major order.
5. **Combine**: the reverse all-to-all-v returns every row to its sender, which multiplies
   by the router weight and sums a token's ``k`` rows into place (unpermute).

The all-to-alls are :class:`AllToAllV` (an autograd function: backward is the reverse
all-to-all), so gradients flow back to the router and the experts. Every call goes through
:func:`labkit.comm.all_to_all_single` and is traced with ``phase`` (``counts``,
``dispatch``, ``combine``), ``layer`` and ``pass`` tags (``forward``, ``backward``, or
``recompute`` for a forward that activation checkpointing repeats during backward).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ... import comm
from ...models.moe import Experts, Routing

__all__ = ["AllToAllV", "ExpertParallelDispatcher"]


class AllToAllV(torch.autograd.Function):
    """Forward: all-to-all-v of rows ``x`` ``(sum(input_splits), ...)`` →
    ``(sum(output_splits), ...)``. Backward: the reverse all-to-all-v (the splits swapped),
    which returns each row's gradient to the rank the row came from.

    Source: GShard (Lepikhin et al. 2020, §3.2: dispatch and combine are all-to-alls);
    Megatron-Core ``tensor_parallel.mappings._AllToAll``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list, input_splits: list, group,
                axis: Optional[str], tags: dict) -> torch.Tensor:
        ctx.meta = (output_splits, input_splits, group, axis, tags)
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group, axis,
                               **tags)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits, group, axis, tags = ctx.meta
        back = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group,
                               axis, **{**tags, "pass": "backward"})
        return back, None, None, None, None, None


class ExpertParallelDispatcher:
    """``MoE.dispatcher`` for expert parallelism over ``group`` (``P`` ranks).

    Called as ``dispatcher(x, routing, experts, layer=..., recompute=...)`` with ``x`` ``(T, H)`` this
    rank's tokens, ``routing`` their :class:`~labkit.models.moe.Routing` over all ``E``
    experts, ``experts`` this rank's slice (``E/P`` experts, ``experts.first`` the first
    global id). Returns ``(T, H)``: the weighted sum of each token's kept expert outputs.

    Attributes:
        last_recv: ``(P, E/P)`` int64 rows received per source rank and local expert in the
            last forward (the count exchange's result).
    """

    def __init__(self, group, axis: Optional[str] = "ep"):
        self.group, self.axis = group, axis
        self.size, self.rank = comm.group_size(group), dist.get_rank(group)
        self.last_recv: Optional[torch.Tensor] = None

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Experts,
                 layer: Optional[int] = None, recompute: bool = False) -> torch.Tensor:
        p, (t, k) = self.size, routing.experts.shape
        n_experts = routing.probs.shape[1]
        n_local = n_experts // p
        if experts.n_local != n_local or experts.first != self.rank * n_local:
            raise ValueError(f"rank {self.rank} of ep={p} must hold experts "
                             f"[{self.rank * n_local}, {(self.rank + 1) * n_local}) of "
                             f"{n_experts}, it holds {experts.n_local} from {experts.first}")
        tags = {"pass": "recompute" if recompute else "forward"}
        if layer is not None:
            tags["layer"] = layer
        # 1. permute: kept choices sorted by expert (token-major order within an expert)
        choice = routing.keep.reshape(-1).nonzero().squeeze(1)
        chosen = routing.experts.reshape(-1)[choice]
        order = torch.argsort(chosen, stable=True)
        choice, chosen = choice[order], chosen[order]
        token = choice // k
        counts = torch.bincount(chosen, minlength=n_experts)
        # 2. count exchange: recv[j, l] = rows from rank j for my local expert l
        recv = torch.empty_like(counts)
        comm.all_to_all_single(recv, counts, None, None, self.group, self.axis,
                               phase="counts", **tags)
        recv = recv.view(p, n_local)
        self.last_recv = recv
        input_splits = counts.view(p, n_local).sum(1).tolist()
        output_splits = recv.sum(1).tolist()
        # 3. dispatch
        send = x[token]
        if torch.is_autocast_enabled(x.device.type):
            # the experts' matmuls cast their input to the autocast dtype anyway: move the
            # rows at that width (half the bytes under bf16), with the same arithmetic
            send = send.to(torch.get_autocast_dtype(x.device.type))
        rows = AllToAllV.apply(send, output_splits, input_splits, self.group, self.axis,
                               {"phase": "dispatch", **tags})
        # 4. local experts: source-major rows → grouped by local expert → back
        local = torch.arange(n_local, device=x.device).repeat(p)
        expert_of_row = local.repeat_interleave(recv.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        chunks = rows[by_expert].split(recv.sum(0).tolist())
        with _compute_in(rows.dtype, experts.w1.dtype, x.device.type):
            outs = torch.cat([experts.expert(i, c) for i, c in enumerate(chunks)])
        outs = outs[torch.argsort(by_expert)]
        # 5. combine: rows back to their senders, weighted, summed per token
        back = AllToAllV.apply(outs, input_splits, output_splits, self.group, self.axis,
                               {"phase": "combine", **tags})
        # weighted and summed in x's dtype, as the dense path does (bf16 autocast: fp32 sum)
        weight = routing.weights.reshape(-1)[choice].to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, back.to(x.dtype) * weight[:, None])


def _compute_in(rows_dtype: torch.dtype, weight_dtype: torch.dtype, device_type: str):
    """The experts' precision when the tokens arrive narrower than the expert weights: bf16
    ZeRO keeps the rest of the model's parameters in bf16 units but leaves the expert
    parameters (reduced over their own group) in fp32, so their matmuls autocast to the
    tokens' dtype, as every other matmul of the step computes in it."""
    import contextlib

    if rows_dtype == weight_dtype or not rows_dtype.is_floating_point \
            or torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=rows_dtype)
