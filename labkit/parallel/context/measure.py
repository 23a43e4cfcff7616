"""Context parallelism measured, beside its formulas: work, bytes, overlap, memory.

* **Work** — unmasked query–key pairs (× batch rows × query heads) each rank computed, from
  its own :class:`.blocks.WorkCounter`, beside :func:`work_closed_form`, and the imbalance
  (busiest rank over the mean).
* **Bytes** — what each rank sent over the ``cp`` axis, from the trace
  (:func:`trace_bytes`), beside :func:`bytes_formula`; exact.
* **Overlap** — for the ring, the fraction of send/recv time (issue to completed ``wait``)
  spent under a block's computation (:func:`ring_overlap`).
* **Memory** — bytes autograd saved for backward on each rank (:class:`SavedTensorMeter`,
  parameters excluded, each storage once) against ``1/cp`` of one rank's figure; the K/V
  working set per method (:func:`kv_working_set_formula`).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ...trace import COMPUTE, P2P
from .layout import causal_pairs_closed_form

__all__ = ["work_closed_form", "bytes_formula", "kv_working_set_formula",
           "activation_formula", "trace_bytes", "ring_overlap", "SavedTensorMeter"]


def work_closed_form(method: str, rank: int, cp: int, seq_len: int, zigzag: bool,
                     causal: bool, batch: int, heads: int) -> int:
    """Unmasked query–key pairs × batch × query heads rank ``rank`` computes per pass.

    Ring and all-gather: this rank's query chunks against the whole sequence, ``heads``
    heads (:func:`.layout.causal_pairs_closed_form`). Ulysses: every query against every
    key for ``heads/cp`` heads, the same on every rank whatever the split.
    """
    if method == "ulysses":
        every = sum(causal_pairs_closed_form(r, cp, seq_len, zigzag, causal) for r in range(cp))
        return batch * (heads // cp) * every
    return batch * heads * causal_pairs_closed_form(rank, cp, seq_len, zigzag, causal)


def _kv_local_bytes(batch, kv_heads, seq_len, cp, head_dim, elem_bytes) -> int:
    return 2 * batch * kv_heads * (seq_len // cp) * head_dim * elem_bytes


def bytes_formula(method: str, cp: int, *, batch: int, heads: int, kv_heads: int,
                  seq_len: int, head_dim: int, elem_bytes: int = 4) -> dict:
    """Bytes one rank sends for one attention call (``heads``/``kv_heads``: this rank's,
    after tensor parallelism): ``{"forward", "backward", "total"}``. With ``kv`` = the local
    K and V, ``2·B·K·(S/cp)·D·e`` bytes, and ``q`` = ``B·A·(S/cp)·D·e``:

    ==========  ====================  =========================================
    method      forward               backward
    ==========  ====================  =========================================
    allgather   (cp−1)·kv             (cp−1)·kv  (reduce-scatter of dK, dV)
    ulysses     (cp−1)/cp·(2q + kv)   (cp−1)/cp·(2q + kv)
    ring        (cp−1)·kv             (cp−1)·kv + cp·kv  (K/V, then dK/dV home)
    ==========  ====================  =========================================

    Fp32 gradient accumulators travel in the ring's backward, so ``elem_bytes`` applies to
    its ``dK``/``dV`` hops only when it is 4.
    """
    kv = _kv_local_bytes(batch, kv_heads, seq_len, cp, head_dim, elem_bytes)
    q = batch * heads * (seq_len // cp) * head_dim * elem_bytes
    if cp == 1:
        fwd = bwd = 0.0
    elif method == "allgather":
        fwd = bwd = float((cp - 1) * kv)
    elif method == "ulysses":
        fwd = bwd = (cp - 1) * (2 * q + kv) / cp
    elif method == "ring":
        fwd = float((cp - 1) * kv)
        bwd = float((cp - 1) * kv + cp * kv * 4 // elem_bytes)
    else:
        raise ValueError(f"unknown context-parallel method {method!r}")
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def kv_working_set_formula(method: str, cp: int, *, batch: int, kv_heads: int, seq_len: int,
                           head_dim: int, elem_bytes: int = 4) -> dict:
    """Most K/V bytes one attention call holds at once, ``{"forward", "backward"}``
    (``kv`` = local K and V as in :func:`bytes_formula`, all fp32):

    * allgather: the whole sequence's K/V, ``cp·kv``; backward adds their gradients, ``2cp·kv``.
    * ulysses: the whole sequence for ``1/cp`` of the heads, ``kv``; backward ``2·kv``.
    * ring: the block held and the one arriving, ``2·kv``; backward also the travelling
      gradient accumulator and the one arriving, ``4·kv`` (``kv`` and ``2·kv`` at cp = 1).
    """
    kv = _kv_local_bytes(batch, kv_heads, seq_len, cp, head_dim, elem_bytes)
    if method == "allgather":
        return {"forward": cp * kv, "backward": 2 * cp * kv}
    if method == "ulysses":
        return {"forward": kv, "backward": 2 * kv}
    if method == "ring":
        return {"forward": 2 * kv if cp > 1 else kv, "backward": 4 * kv if cp > 1 else 2 * kv}
    raise ValueError(f"unknown context-parallel method {method!r}")


def activation_formula(method: str, cp: int, single_rank_bytes: int, *, n_layers: int,
                       batch: int, kv_heads: int, seq_len: int, head_dim: int,
                       elem_bytes: int = 4, heads: int = 0) -> float:
    """Bytes one rank's forward saves for backward under ``cp``-way context parallelism,
    from the single-rank figure of the same model and attention algorithm:

    * everything per token shrinks to ``1/cp``;
    * plus the rotary rows of this rank's positions, ``(S/cp)·D`` fp32 values (cos and sin,
      ``D/2`` each): gathered by position, they are new tensors, where one rank slices views
      of the table;
    * all-gather also keeps the gathered K/V instead of its own, ``(cp−1)·kv`` per layer
      (``kv`` = ``2·B·K·(S/cp)·D·e``);
    * Ulysses keeps the attention output twice per layer: head-sharded by its attention
      (for backward) and, after the second all-to-all, sequence-sharded as the output
      projection's input, ``B·(S/cp)·A·D·e`` (``A`` = ``heads``), where one rank's
      projection reads the attention's own output as a view.
    """
    if cp == 1:
        return float(single_rank_bytes)
    rope = (seq_len // cp) * head_dim * 4
    extra = 0
    if method == "allgather":
        extra = n_layers * (cp - 1) * _kv_local_bytes(batch, kv_heads, seq_len, cp, head_dim,
                                                      elem_bytes)
    elif method == "ulysses":
        extra = n_layers * batch * (seq_len // cp) * heads * head_dim * elem_bytes
    return single_rank_bytes / cp + rope + extra


def trace_bytes(events: Iterable, rank: int, phase: Optional[str] = None,
                axis: str = "cp", direction: str = "sent") -> float:
    """Bytes ``rank`` sent (or received) on ``axis`` in the recorded ``events`` (a
    :class:`labkit.trace.Trace` or a list of events), optionally one ``phase`` only."""
    key = "bytes_sent" if direction == "sent" else "bytes_recv"
    evs = events.events if hasattr(events, "events") else events
    return sum(getattr(e, key) for e in evs
               if e.rank == rank and e.cat != COMPUTE and e.axis == axis
               and (phase is None or e.args.get("phase") == phase))


def _merged(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def ring_overlap(events: Iterable, rank: int, phase: Optional[str] = None) -> float:
    """Fraction (0–1) of ``rank``'s ring send/recv time spent under block computation.

    Each message's span runs from being posted to its completed ``wait()``; the part of it
    covered by a ``cp.ring.forward``/``cp.ring.backward`` compute region was hidden, the rest
    was waited for. 0 when there was no ring traffic.
    """
    evs = events.events if hasattr(events, "events") else events
    comm = [(e.start, e.end) for e in evs if e.rank == rank and e.cat == P2P
            and e.axis == "cp" and (phase is None or e.args.get("phase") == phase)]
    names = [f"cp.ring.{phase}"] if phase else ["cp.ring.forward", "cp.ring.backward"]
    busy = _merged((e.start, e.end) for e in evs
                   if e.rank == rank and e.cat == COMPUTE and e.name in names)
    total = sum(e - s for s, e in comm)
    if total <= 0:
        return 0.0
    hidden = sum(max(0.0, min(ce, be) - max(cs, bs)) for cs, ce in comm for bs, be in busy)
    return min(1.0, hidden / total)


class SavedTensorMeter:
    """Bytes autograd saves for backward inside the ``with`` body (activation memory).

    Each storage counts once; tensors whose storage belongs to ``exclude`` (a module's
    parameters and buffers, or any tensors) are not activations and are skipped. Source:
    ``torch.autograd.graph.saved_tensors_hooks`` (DESIGN §8: it sees saved tensors on CPU,
    custom autograd Functions' ``save_for_backward`` included).

    Attributes:
        bytes: saved bytes counted so far.
    """

    def __init__(self, exclude=()):
        self._skip = {t.untyped_storage().data_ptr() for t in _tensors(exclude)}
        self._seen: set = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += st.nbytes()
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _tensors(x):
    if isinstance(x, torch.nn.Module):
        return list(x.parameters()) + list(x.buffers())
    return list(x)
