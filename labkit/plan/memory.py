"""Bytes of model state per rank under data parallelism and ZeRO (claims C10, C11, C12).

Model state is what lives for the whole run, independent of the batch: parameters,
gradients and optimizer state (activations are the batch-dependent rest). With ``Ψ``
parameters and Adam:

==================  ==========  =========  =====================================  =====
precision           parameters  gradients  optimizer                              total
==================  ==========  =========  =====================================  =====
mixed (bf16/fp16)   2Ψ          2Ψ         12Ψ: fp32 master 4Ψ + Adam m 4Ψ + v 4Ψ  16Ψ
fp32                4Ψ          4Ψ         8Ψ: Adam m 4Ψ + v 4Ψ                   16Ψ
==================  ==========  =========  =====================================  =====

ZeRO (Rajbhandari et al. 2020, §5.1, Figure 1, with K = 12) shards across ``N`` data-parallel
ranks: stage 1 (P_os) the optimizer state, stage 2 (P_os+g) also the gradients, stage 3
(P_os+g+p, = FSDP) also the parameters. Per rank, mixed precision:
DP ``16Ψ``; stage 1 ``4Ψ + 12Ψ/N``; stage 2 ``2Ψ + 14Ψ/N``; stage 3 ``16Ψ/N``.

Units are bytes; :data:`GB` (1e9) and :data:`GiB` (2**30) are there to convert. The
lectures use decimal GB for these examples.
"""
from __future__ import annotations

__all__ = ["BYTES_PER_PARAM", "model_state_bytes", "sharded_state_bytes", "rank_memory", "GB",
           "GiB"]

GB = 1e9        # decimal gigabyte, bytes
GiB = 2 ** 30   # binary gibibyte, bytes

#: bytes per parameter for (parameters, gradients, optimizer) with Adam
BYTES_PER_PARAM = {
    "mixed": {"parameters": 2, "gradients": 2, "optimizer": 12},
    "fp32": {"parameters": 4, "gradients": 4, "optimizer": 8},
}


def model_state_bytes(n_params: float, n_ranks: int = 1, zero_stage: int = 0,
                      mixed_precision: bool = True) -> dict[str, float]:
    """Bytes of parameters, gradients and Adam state held by **one** rank.

    Args:
        n_params: parameters ``Ψ`` of the whole model.
        n_ranks: data-parallel ranks ``N`` sharing the model state.
        zero_stage: 0 (plain DP: everything replicated), 1 (optimizer state / N),
            2 (gradients and optimizer state / N), 3 (everything / N).
        mixed_precision: bf16 parameters and gradients plus fp32 master weights (2/2/12
            bytes per parameter) or plain fp32 (4/4/8).

    Returns:
        ``{"parameters", "gradients", "optimizer", "total"}`` in bytes (floats: a shard of
        ``Ψ/N`` need not be whole).

    Raises:
        ValueError: negative ``n_params``, ``n_ranks < 1`` or a stage outside 0–3.

    Example: 7.5e9 parameters, plain DP, mixed precision → 120e9 bytes per GPU however
    many GPUs (claim C11); with ZeRO-3 on 64 GPUs → 1.875e9 bytes.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if int(n_ranks) != n_ranks or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive integer, got {n_ranks!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    per = BYTES_PER_PARAM["mixed" if mixed_precision else "fp32"]
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"),
               3: ("optimizer", "gradients", "parameters")}[zero_stage]
    out = {}
    for cat, b in per.items():
        total = float(b) * n_params
        out[cat] = total / n_ranks if cat in sharded else total
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out


def sharded_state_bytes(n_params: float, values_per_param: int = 4, bytes_per_value: int = 2,
                        n_ranks: int = 1) -> dict[str, float]:
    """The CS231N lecture's back-of-envelope count: every value evenly sharded (FSDP).

    ``total = n_params · values_per_param · bytes_per_value`` and ``per_rank = total / N``.
    The lecture counts 4 values (parameter, gradient, Adam's two moments) of 2 bytes: 100e9
    parameters → 800 GB, 10 GB on each of 80 GPUs (claim C12). (It leaves out fp32 master
    weights; :func:`model_state_bytes` keeps them.)

    Raises:
        ValueError: negative sizes or ``n_ranks < 1``.
    """
    if n_params < 0 or values_per_param < 0 or bytes_per_value < 0:
        raise ValueError("sizes must be >= 0")
    if int(n_ranks) != n_ranks or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive integer, got {n_ranks!r}")
    total = float(n_params) * values_per_param * bytes_per_value
    return {"total": total, "per_rank": total / n_ranks}


def rank_memory(params: float, zero: int, shard: int, grad_bytes: int = 2,
                activations: float = 0.0, comm_buffers: float = 0.0, param_bytes: int = 2,
                optimizer_bytes: int = 12, unsharded: float = 0.0,
                unsharded_group: int = 1) -> dict[str, float]:
    """Bytes one GPU holds by category, for a model shard of ``params`` parameters.

    Parameters ``param_bytes·P`` (2: 16-bit), gradients ``grad_bytes·P``, Adam
    ``optimizer_bytes·P`` (12: fp32 master, m, v; 8: m, v over fp32 weights), each divided
    by ``shard`` (the ZeRO group) as ``zero`` says — stage 1 the optimizer, 2 also the
    gradients, 3 also the parameters (ZeRO §5.1) — plus ``activations`` and
    ``comm_buffers``. With the defaults and ``grad_bytes=2`` the first three are
    :func:`model_state_bytes`.

    ``unsharded`` of the ``params`` (expert parameters under expert parallelism) are
    sharded over ``unsharded_group`` ranks instead of ``shard`` (1: held whole).

    Returns:
        ``{"parameters", "gradients", "optimizer", "activations", "comm_buffers",
        "total"}`` in bytes.

    Raises:
        ValueError: a stage outside 0–3 or ``shard < 1``.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if shard < 1 or unsharded_group < 1:
        raise ValueError(f"shard and unsharded_group must be >= 1, got {shard}, "
                         f"{unsharded_group}")
    if not 0 <= unsharded <= params:
        raise ValueError(f"unsharded={unsharded} must be in 0..params={params}")
    rest = params - unsharded

    def state(per: float, from_stage: int) -> float:
        if zero < from_stage:
            return per * params
        return per * (rest / shard + unsharded / unsharded_group)

    out = {"parameters": state(float(param_bytes), 3),
           "gradients": state(float(grad_bytes), 2),
           "optimizer": state(float(optimizer_bytes), 1),
           "activations": float(activations), "comm_buffers": float(comm_buffers)}
    out["total"] = sum(out.values())
    return out
