"""The GPT cut into pipeline stages, the zero-bubble backward split, activation metering.

* :class:`StageModule` — stage ``s`` of ``n``: a contiguous run of transformer blocks
  (equal runs, or uneven ones: :mod:`.split`); stage 0 also holds the token embedding,
  the last stage the final norm and the head. Input
  ``(b, S)`` token ids (stage 0) or ``(b, S, H)`` activations; output ``(b, S, H)``, or
  logits ``(b, S, V)`` on the last stage.
* :class:`SplitLinear` + :class:`WeightGradStore` — the ``B``/``W`` split of Qi et al. 2023
  §2 (and their Megatron implementation's ``WeightGradStore``): during ``B`` a linear layer
  computes only ``dX = dY·W`` and stores ``(X, dY)``; ``W`` later computes
  ``dW = dYᵀ·X``. Nothing downstream waits for ``dW``, so ``W`` can move into bubbles.
  (RMSNorm weights and the embedding are cheap and still get their gradients during ``B``.)
* :class:`ActivationMeter` — saved-for-backward bytes per stage-microbatch, seen with
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters and buffers excluded, each
  storage once) and live until the storage itself is freed (a weak reference's callback).

Tied embeddings: every rank builds the full GPT from the seed and keeps its stages, so when
the first and last stage share a rank (``P = 1``, ZB-V) the head *is* the embedding
parameter; otherwise the two ranks hold copies and :class:`TiedEmbedding` exchanges their
gradients with a send/recv pair after backward (Megatron-LM's embedding-group all-reduce,
Shoeybi et al. 2019, done point-to-point), so both copies take the same update.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ... import comm
from ...config import ModelConfig
from ...models import build_model
from ...models.gpt import rope_slice
from .actions import check_pp_ranks
from .split import layer_ranges

__all__ = ["StageModule", "build_stages", "layer_ranges", "SplitLinear", "WeightGradStore",
           "ActivationMeter", "TiedEmbedding"]


class StageModule(nn.Module):
    """Stage ``stage`` of ``n_stages`` carved out of a built ``GPT`` (weights shared).

    Its layers are the ``stage``-th contiguous run of :func:`~.split.layer_ranges`: equal
    runs when ``n_stages`` divides the layers, else the uneven default rule (the first and
    last stages give up layers first: 126 layers on 16 stages hold 7, 8, …, 8, 7), or the
    explicit per-stage counts ``stage_layers``.

    Raises:
        ValueError: more stages than layers, a bad ``stage_layers`` (see
            :func:`~.split.stage_layer_counts`).
    """

    def __init__(self, gpt: nn.Module, stage: int, n_stages: int,
                 stage_layers: Optional[Sequence[int]] = None):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layer_ids = list(layer_ranges(len(gpt.layers), n_stages, stage_layers)[stage])
        self.tok_emb = gpt.tok_emb if self.is_first else None
        self.layers = nn.ModuleList(gpt.layers[i] for i in self.layer_ids)
        self.norm = gpt.norm if self.is_last else None
        self.head = gpt.head if self.is_last else None
        self.register_buffer("rope_cos", gpt.rope_cos, persistent=False)
        self.register_buffer("rope_sin", gpt.rope_sin, persistent=False)
        self.positions = gpt.positions  # see GPT.positions (context parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok_emb(x)
        rope = rope_slice(self.rope_cos, self.rope_sin, x.shape[1], self.positions)
        for layer in self.layers:
            x = layer(x, rope)
        if self.is_last:
            x = self.head(self.norm(x))
        return x

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy (nats) of logits ``(b, S, V)`` against ``(b, S)``: the mean over the
        tokens, or with ``reduction="sum"`` their sum (the one training job divides that by
        the global token count). Tensor parallelism replaces it with the vocab-parallel
        cross-entropy."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction=reduction)

    def full_name(self, name: str) -> str:
        """Local parameter name → the full GPT's (``layers.0.…`` → ``layers.{first}.…``)."""
        if name.startswith("layers."):
            _, k, rest = name.split(".", 2)
            return f"layers.{self.layer_ids[int(k)]}.{rest}"
        return name


def build_stages(model_cfg: ModelConfig, stages: list, n_stages: int, seed: int = 0,
                 device="cpu", split_backward: bool = False,
                 store: Optional["WeightGradStore"] = None,
                 stage_layers: Optional[Sequence[int]] = None) -> dict:
    """``{stage: StageModule}`` for this rank's ``stages``, from one GPT built with ``seed``
    (so every rank's copy of a weight is bit-identical). With ``split_backward`` the linear
    layers become :class:`SplitLinear` sharing ``store``; ``stage_layers`` as in
    :class:`StageModule`."""
    gpt = build_model(model_cfg, device=device, seed=seed)
    out = {s: StageModule(gpt, s, n_stages, stage_layers) for s in stages}
    if split_backward:
        store = store if store is not None else WeightGradStore()
        for mod in out.values():
            _swap_linears(mod, store)
    return out


class WeightGradStore:
    """Deferred ``(module, X, dY)`` triples, keyed by ``(stage, microbatch)``.

    Set :attr:`key` before running ``B``; :meth:`flush` (the ``W`` pass) computes and
    accumulates ``dW = dYᵀ X`` (``dY`` ``(…, out)``, ``X`` ``(…, in)`` → ``(out, in)``)."""

    def __init__(self):
        self.key = None
        self.pending: dict = defaultdict(list)

    def add(self, module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
        self.pending[self.key].append((module, x, grad))

    @torch.no_grad()
    def flush(self, key) -> None:
        # without no_grad, dW would carry a graph back through X to the stage's input (X
        # comes from the saved tensors, which still require grad): every microbatch's
        # activations would stay alive in .grad until the optimizer step
        for module, x, g in self.pending.pop(key, []):
            w = module.weight
            # under bf16 autocast X and dY are bf16: the product is bf16, cast to the fp32
            # weight's dtype as autograd's own cast node does on the fused path
            gw = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(w.dtype)
            w.grad = gw if w.grad is None else w.grad.add_(gw)

    def __len__(self) -> int:
        return len(self.pending)


class _InputGradOnlyLinear(torch.autograd.Function):
    """``Y = X Wᵀ``; backward returns ``dX = dY W`` and defers ``dW`` to the store."""

    @staticmethod
    def forward(ctx, x, weight, module):
        ctx.save_for_backward(x)
        ctx.module = module
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        ctx.module.store.add(ctx.module, x, grad)
        return grad @ ctx.module.weight, None, None


class SplitLinear(nn.Module):
    """A bias-free ``nn.Linear`` whose weight gradient waits for the ``W`` pass."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("SplitLinear handles bias-free linears (as in labkit's GPT)")
        self.weight = linear.weight  # the same Parameter: names and ties are kept
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InputGradOnlyLinear.apply(x, self.weight, self)


def _swap_linears(module: nn.Module, store: WeightGradStore) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, SplitLinear(child, store))
        else:
            _swap_linears(child, store)


class ActivationMeter:
    """Bytes saved for backward per stage-microbatch, and their peak on this rank, measured
    from the saved tensors themselves.

    Under :meth:`forward` a saved-tensor pack hook sees every tensor autograd keeps for
    backward; the meter counts each storage once (parameters, buffers and the storages
    passed to :meth:`ignore` excluded) and holds a weak reference to it, whose callback
    fires when the storage is freed — when the backward pass (or the ``W`` pass, or
    anything else still holding it) lets go. So what is live is what memory still holds,
    whoever holds it; nothing here is told when an activation "should" be released.

    Attributes:
        live: ``{(stage, microbatch): bytes}`` of storages still alive.
        peak_bytes: the most saved bytes alive at once (sampled at every pack).
        peak_count: the most stage-microbatches with any saved storage alive at once.
    """

    def __init__(self, modules: list, enabled: bool = True, weights: tuple = ()):
        self.enabled = enabled
        # by storage object, not address: ZeRO-3 frees a unit's flat storage after use and
        # re-gathers it at a new address; ``weights`` are such buffers (ZeRO's flat units),
        # whose views the modules use as weights without owning them as parameters
        self.exclude = {t.untyped_storage()._cdata for m in modules
                        for t in list(m.parameters()) + list(m.buffers())}
        self.exclude |= {t.untyped_storage()._cdata for t in weights}
        self.ignored: set = set()
        self._storages: dict = {}  # data_ptr -> [weakref, bytes, key it was first saved under]
        self.live: dict = {}
        self._refs: dict = defaultdict(int)  # key -> live storages first saved under it
        self.peak_bytes = self.peak_count = 0
        self._bytes = 0

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Do not count these tensors' storages (e.g. the flush's input batch: data, not
        activations). Replaces the previous call's set."""
        self.ignored = {t.untyped_storage().data_ptr() for t in tensors}

    def _freed(self, ptr: int) -> None:
        entry = self._storages.pop(ptr, None)
        if entry is None:
            return
        _, nbytes, key = entry
        self._bytes -= nbytes
        self.live[key] -= nbytes
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key], self.live[key]

    @contextmanager
    def forward(self, key) -> Iterator[None]:
        """Count what the ``with`` body saves for backward under ``key``."""
        if not self.enabled:
            yield
            return

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if st._cdata in self.exclude or ptr in self.ignored or ptr in self._storages \
                    or st.nbytes() == 0:
                return t
            ref = weakref.ref(st, lambda _r, ptr=ptr: self._freed(ptr))
            self._storages[ptr] = [ref, st.nbytes(), key]
            self._bytes += st.nbytes()
            self.live[key] = self.live.get(key, 0) + st.nbytes()
            self._refs[key] += 1
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            self.peak_count = max(self.peak_count, len(self._refs))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


class TiedEmbedding:
    """Sum the tied embedding/head gradient between the first and last stage's ranks.

    A no-op when the model is untied or both stages are on one rank (one parameter).

    Args:
        model_cfg: the model (``tie_embeddings``).
        schedule: the pipeline :class:`~.actions.Schedule` (which stage-rank holds stage 0
            and the last stage).
        rank: this rank's stage-rank ``0 … P−1``.
        stages: ``{stage: StageModule}`` this rank holds.
        group: the pipeline process group.
        pp_ranks: global rank of each stage-rank (``None`` = ``0 … P−1``): the peer is
            addressed by its global rank, so pipelines on other ranks of the pool can run
            at the same time.

    Raises:
        ValueError: a bad ``pp_ranks`` (see :func:`~.actions.check_pp_ranks`).
    """

    TAG = 2**30 - 1

    def __init__(self, model_cfg: ModelConfig, schedule, rank: int, stages: dict, group=None,
                 pp_ranks: Optional[Sequence[int]] = None):
        self.pp_ranks = check_pp_ranks(pp_ranks, schedule.pp)
        first, last = schedule.stage_rank(0), schedule.stage_rank(schedule.n_stages - 1)
        self.param, self.peer, self.group = None, None, group
        if model_cfg.tie_embeddings and first != last and rank in (first, last):
            mod = stages[0] if rank == first else stages[schedule.n_stages - 1]
            self.param = mod.tok_emb.weight if rank == first else mod.head.weight
            self.peer = self.pp_ranks[last if rank == first else first]

    def sync(self) -> None:
        if self.param is None or self.param.grad is None:
            return
        g = self.param.grad
        other = torch.empty_like(g)
        hs = comm.isend(g, self.peer, self.group, axis="pp", tag=self.TAG)
        hr = comm.irecv(other, self.peer, self.group, axis="pp", tag=self.TAG)
        hs.wait()
        hr.wait()
        g.add_(other)  # a + b == b + a exactly: both copies stay bit-identical
