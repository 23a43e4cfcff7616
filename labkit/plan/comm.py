"""Bytes each rank sends in a collective, for ring algorithms (claims C6, C9, C13–C15).

In a ring of ``N`` ranks a buffer of ``S`` bytes is cut into ``N`` chunks and every step
each rank passes one chunk to its neighbour (Patarasuk & Yuan 2009; NCCL's ring):

===============================  ======================  ==================================
collective                       bytes sent per rank     ``S`` is
===============================  ======================  ==================================
all_reduce                       ``2·(N−1)/N · S``       the buffer every rank holds
reduce_scatter                   ``(N−1)/N · S``         the full input (each keeps S/N)
all_gather                       ``(N−1)/N · S``         the full output (each owns S/N)
all_to_all                       ``(N−1)/N · S``         one rank's send buffer
broadcast, reduce                ``S``                   the buffer (pipelined ring/chain)
send_recv                        ``S``                   the message
===============================  ======================  ==================================

All-reduce = reduce-scatter + all-gather, hence twice the bytes (claim C5). With one rank
nothing is sent. The same factors are nccl-tests' *bus bandwidth* factors
(nccl-tests ``doc/PERFORMANCE.md``): ``busbw = algbw · factor`` with ``algbw = S / time``,
so that ``busbw`` is comparable with the link's hardware bandwidth for every collective.
"""
from __future__ import annotations

__all__ = ["COLLECTIVES", "normalize_collective", "busbw_factor", "comm_bytes",
           "dp_step_comm_bytes", "expert_all_to_all_bytes"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
               "reduce", "send_recv")
_ALIASES = {c.replace("_", ""): c for c in COLLECTIVES}
_ALIASES.update({"alltoall": "all_to_all", "sendrecv": "send_recv", "p2p": "send_recv",
                 "allgatherintotensor": "all_gather", "reducescattertensor": "reduce_scatter"})


def normalize_collective(name: str) -> str:
    """Canonical name: ``"AllReduce"``, ``"all-reduce"``, ``"allreduce"`` → ``"all_reduce"``.

    Raises:
        ValueError: listing the known collectives.
    """
    key = str(name).lower().replace("_", "").replace("-", "").replace(" ", "")
    try:
        return _ALIASES[key]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}; known: {', '.join(COLLECTIVES)}") \
            from None


def _check_n(n_ranks: int) -> int:
    if isinstance(n_ranks, bool) or int(n_ranks) != n_ranks or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive integer, got {n_ranks!r}")
    return int(n_ranks)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (``busbw = algbw · factor``) for ``n`` ranks.

    all_reduce ``2(n−1)/n``; reduce_scatter, all_gather, all_to_all ``(n−1)/n``;
    broadcast, reduce, send_recv ``1``.

    Raises:
        ValueError: unknown collective or ``n < 1``.
    """
    c, n = normalize_collective(collective), _check_n(n)
    if c == "all_reduce":
        return 2.0 * (n - 1) / n
    if c in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def comm_bytes(collective: str, size_bytes: float, n_ranks: int) -> float:
    """Bytes one rank sends for ``collective`` on ``size_bytes`` over a ring of ``n_ranks``.

    See the module table for what ``size_bytes`` means per collective. One rank → 0.

    Raises:
        ValueError: unknown collective, negative size or ``n_ranks < 1``.
    """
    n = _check_n(n_ranks)
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    if n == 1:
        return 0.0
    return busbw_factor(collective, n) * float(size_bytes)


def dp_step_comm_bytes(n_params: float, n_ranks: int, bytes_per_elem: int = 4,
                       zero_stage: int = 0) -> float:
    """Bytes one data-parallel rank sends per optimizer step to synchronize ``n_params``.

    Plain DP, ZeRO-1 and ZeRO-2: one all-reduce of the gradients, or the equal
    reduce-scatter + all-gather: ``2·(N−1)/N · |θ|`` ≈ ``2·|θ|`` (claims C9, C13, C14).
    ZeRO-3 / FSDP: all-gather in forward, all-gather in backward, reduce-scatter:
    ``3·(N−1)/N · |θ|``, 50 % more (claim C15). ``|θ| = n_params · bytes_per_elem``.

    Raises:
        ValueError: bad ``n_ranks``, negative sizes or a stage outside 0–3.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if n_params < 0 or bytes_per_elem <= 0:
        raise ValueError("n_params must be >= 0 and bytes_per_elem > 0")
    size = float(n_params) * bytes_per_elem
    if zero_stage == 3:
        return 2 * comm_bytes("all_gather", size, n_ranks) + comm_bytes("reduce_scatter", size,
                                                                        n_ranks)
    return comm_bytes("all_reduce", size, n_ranks)


def expert_all_to_all_bytes(tokens: int, d_model: int, top_k: int, n_experts: int, ep: int,
                            bytes_per_elem: int = 4, sent_fraction: float | None = None,
                            recompute: bool = False) -> dict[str, float]:
    """Bytes one rank sends in the all-to-alls of ONE mixture-of-experts layer for one
    microbatch of ``tokens`` tokens, under expert parallelism over ``ep`` ranks.

    The token dispatcher (GShard, Lepikhin et al. 2020 §3.2; Megatron-Core's all-to-all
    dispatcher; :mod:`labkit.parallel.expert.dispatch`) moves a token's ``k`` routed rows of
    ``h`` elements to the ranks holding their experts and back:

    * ``counts``: an all-to-all of the ``E`` int64 per-expert counts, each forward:
      ``(ep−1)/ep · E · 8`` bytes;
    * ``dispatch``: forward, the rows bound for other ranks, ``f · T·k · h · b``; backward
      (the reverse all-to-all) the gradients of the rows other ranks sent here, the same
      under balanced traffic;
    * ``combine``: forward, the expert outputs returned to their senders; backward, their
      gradients sent to the experts: again ``2 · f · T·k · h · b``.

    ``f`` is ``sent_fraction``, the share of this rank's ``T·k`` rows whose expert lives
    on another rank: ``(ep−1)/ep`` for balanced routing (the default); a measured value
    (rows to other ranks over ``T·k``, dropped rows excluded) reproduces a run. The
    backward halves assume the rank receives as many rows as it sends, which holds for the
    sum over the ``ep`` ranks. ``recompute``: activation checkpointing repeats the forward
    all-to-alls (counts, dispatch and combine) in backward. ``b`` is ``bytes_per_elem``
    (2 under bf16 autocast: the rows move at that width).

    Returns:
        ``{"counts", "dispatch", "combine", "total"}`` in bytes.

    Raises:
        ValueError: a non-positive size, ``ep`` not dividing ``n_experts``, ``top_k`` above
            ``n_experts``, or ``sent_fraction`` outside ``[0, 1]``.
    """
    for name, v in (("tokens", tokens), ("d_model", d_model), ("top_k", top_k),
                    ("n_experts", n_experts), ("ep", ep), ("bytes_per_elem", bytes_per_elem)):
        if isinstance(v, bool) or int(v) != v or v < (0 if name == "tokens" else 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_experts % ep or top_k > n_experts:
        raise ValueError(f"ep={ep} must divide n_experts={n_experts} and top_k={top_k} "
                         "must not exceed it")
    f = (ep - 1) / ep if sent_fraction is None else float(sent_fraction)
    if not 0.0 <= f <= 1.0 or (ep == 1 and f):
        raise ValueError(f"sent_fraction must be in [0, 1] (0 with ep=1), got {sent_fraction!r}")
    passes = 2 if recompute else 1                  # forwards that run the all-to-alls
    rows = f * tokens * top_k * d_model * bytes_per_elem
    counts = passes * (ep - 1) / ep * n_experts * 8
    dispatch = combine = (passes + 1) * rows      # the forward(s) and one backward
    return {"counts": counts, "dispatch": dispatch, "combine": combine,
            "total": counts + dispatch + combine}
