"""Turn a built model into its expert-parallel shard, and back for parity checks.

The interface a training job composes (after the pipeline split, tensor and context
parallelism, before checkpointing and data parallelism, DESIGN §9):

* :func:`check_expert_parallel` — before any rank starts: ``ValueError`` naming the numbers.
* :func:`apply_expert_parallel` — in place, on a full-weight ``GPT`` or ``StageModule``
  built from the seed: each rank keeps its ``E/ep`` experts per layer (a slice of the full
  weights, so every rank's experts equal the single-process model's) and routes tokens with
  :class:`~labkit.parallel.expert.dispatch.ExpertParallelDispatcher`.
* :func:`expert_parameters` — the parameters whose gradients are reduced over the
  expert-data group (``edp``: the ranks holding the same experts) instead of the dense
  data group (``dp × cp``). The routers are dense: every rank holds and uses all of them.
* :func:`gather_full_state` — the full model's parameters (or gradients) on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.distributed as dist
from torch import nn

from ... import comm
from ...models.moe import Experts, moe_layers
from .dispatch import ExpertParallelDispatcher

__all__ = ["ExpertParallelInfo", "check_expert_parallel", "apply_expert_parallel",
           "expert_parameters", "gather_full_state", "expert_param_bytes"]


@dataclass(frozen=True)
class ExpertParallelInfo:
    """What :func:`apply_expert_parallel` did on this rank.

    Attributes:
        ep: ranks in the ``ep`` group; rank: this rank's index in it.
        n_experts: experts per layer; first, n_local: this rank's ``[first, first+n_local)``.
        layers: the MoE layer ids converted (GPT layer indices).
        expert_names: names of this module's expert parameters (reduced over ``edp``).
        local_expert_numel, full_expert_numel: expert elements held here / in the full model
            (``full = ep · local``).
        expert_bytes: bytes of the expert storages this rank holds (storage accounting).
    """

    ep: int
    rank: int
    n_experts: int
    first: int
    n_local: int
    layers: tuple
    expert_names: tuple
    local_expert_numel: int
    full_expert_numel: int
    expert_bytes: int


def check_expert_parallel(model_cfg, ep: int, data_ranks: int) -> None:
    """Refuse an expert-parallel layout that cannot run, before any rank starts.

    Args:
        model_cfg: the :class:`~labkit.config.ModelConfig`.
        ep: ranks the experts of a layer are split over.
        data_ranks: ``dp_replicate × dp_shard × cp``, the ranks ``ep`` is a view over.

    Raises:
        ValueError: ``ep`` not a positive int; ``ep > 1`` on a dense model; ``n_experts``
            not divisible by ``ep``; ``top_k > n_experts``; ``ep`` not dividing
            ``data_ranks`` (each naming the numbers).
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if isinstance(data_ranks, bool) or not isinstance(data_ranks, int) or data_ranks < 1:
        raise ValueError(f"data_ranks must be a positive int, got {data_ranks!r}")
    n, k = model_cfg.n_experts, model_cfg.top_k
    if n and k > n:
        raise ValueError(f"top_k={k} exceeds n_experts={n}")
    if ep == 1:
        return
    if not n:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model, but "
                         f"ModelConfig.n_experts=0 (dense); use e.g. the 'tiny-moe' preset")
    if n % ep:
        raise ValueError(f"n_experts={n} is not divisible by ep={ep}: each of the {ep} ranks "
                         f"holds n_experts/ep experts")
    if data_ranks % ep:
        raise ValueError(f"ep={ep} must divide the data ranks dp x cp = {data_ranks} "
                         "(dp_replicate x dp_shard x cp): expert parallelism is a view over "
                         "them and adds no ranks")


def _shard(experts: Experts, rank: int, ep: int) -> None:
    n_local = experts.n_experts // ep
    lo = rank * n_local
    for name in ("w1", "w3", "w2"):
        full = getattr(experts, name)
        # clone: the slice must not keep the full storage alive (memory is E/ep per rank)
        piece = nn.Parameter(full.detach()[lo:lo + n_local].clone(),
                             requires_grad=full.requires_grad)
        setattr(experts, name, piece)
    experts.first = lo


def apply_expert_parallel(module: nn.Module, ep_group) -> ExpertParallelInfo:
    """Make ``module`` (a full-weight ``GPT``, ``StageModule`` or ``MoE``) expert-parallel
    over ``ep_group``, in place: rank ``r`` keeps experts ``[r·E/ep, (r+1)·E/ep)`` of every
    MoE layer and dispatches tokens to their owners by all-to-all. Build the optimizer and
    data-parallel wrappers afterwards (the expert parameters are new tensors).

    ``ep_group`` of one rank (or ``None``) leaves the module dense.

    Returns:
        :class:`ExpertParallelInfo`.

    Raises:
        ValueError: no MoE layer in ``module``; ``n_experts`` not divisible by ``ep``; the
            module was already converted.
    """
    layers = moe_layers(module)
    if not layers:
        raise ValueError("apply_expert_parallel: the module has no MoE layer "
                         "(ModelConfig.n_experts=0)")
    ep = 1 if ep_group is None else comm.group_size(ep_group)
    rank = 0 if ep_group is None else dist.get_rank(ep_group)
    n = layers[0].n_experts
    full_numel = sum(p.numel() for m in layers for p in m.experts.parameters())
    for m in layers:
        if m.dispatcher is not None or m.experts.n_local != m.n_experts:
            raise ValueError("apply_expert_parallel: the module is already expert-parallel")
        if m.n_experts % ep:
            raise ValueError(f"n_experts={m.n_experts} is not divisible by ep={ep}")
    if ep > 1:
        for m in layers:
            _shard(m.experts, rank, ep)
            m.dispatcher = ExpertParallelDispatcher(ep_group, "ep")
    names = tuple(name for name, _ in expert_parameters(module))
    local_numel = sum(p.numel() for m in layers for p in m.experts.parameters())
    return ExpertParallelInfo(ep, rank, n, rank * (n // ep), n // ep,
                              tuple(m.layer_id for m in layers), names, local_numel, full_numel,
                              expert_param_bytes(module))


def expert_parameters(module: nn.Module) -> list:
    """``[(name, parameter)]`` of the experts in ``module`` (names as ``module`` gives them):
    their gradients are summed over the expert-data group, everything else over ``dp × cp``."""
    ids = {id(p) for m in moe_layers(module) for p in m.experts.parameters()}
    return [(n, p) for n, p in module.named_parameters() if id(p) in ids]


def expert_param_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind the expert parameters of ``module``
    (storage accounting: what this rank really holds, views counted once)."""
    seen, total = set(), 0
    for _, p in expert_parameters(module):
        st = p.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def gather_full_state(module: nn.Module, ep_group, grads: bool = False) -> dict:
    """``{full name: tensor}`` of every parameter of ``module`` (or its gradient, zeros when
    ``None``), with each expert parameter all-gathered over ``ep_group`` into its full
    ``(E, …)`` tensor. Collective: every rank of ``ep_group`` must call it. Names are the
    GPT's (a ``StageModule``'s local names are mapped with ``full_name``).
    """
    ep = 1 if ep_group is None else comm.group_size(ep_group)
    expert_ids = {id(p) for _, p in expert_parameters(module)}
    rename = getattr(module, "full_name", lambda n: n)
    out = {}
    for name, p in module.named_parameters():
        t = p.detach() if not grads else (p.grad if p.grad is not None
                                         else torch.zeros_like(p))
        t = t.detach().contiguous()
        if id(p) in expert_ids and ep > 1:
            full = t.new_empty((ep * t.shape[0],) + tuple(t.shape[1:]))
            comm.all_gather(full, t, ep_group, axis="ep")
            t = full
        out[rename(name)] = t.clone()
    return out
