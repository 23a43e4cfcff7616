"""Pre-launch check of a tensor-parallel layout: pure arithmetic on the model's shape."""
from __future__ import annotations

__all__ = ["check_tensor_parallel"]


def check_tensor_parallel(model_cfg, tp: int, sequence_parallel: bool = False,
                          seq_len: int | None = None) -> None:
    """Raise ``ValueError`` naming the numbers when ``tp`` cannot split ``model_cfg``.

    Checks (Megatron-LM's own): ``tp ≥ 1``; ``tp ≤ n_heads`` and ``n_heads % tp == 0`` (query
    heads are split); ``kv_heads % tp == 0`` or, with fewer K/V heads than ranks,
    ``tp % kv_heads == 0`` (each K/V head then serves ``tp/kv_heads`` ranks); ``ffn_dim % tp
    == 0`` (SwiGLU columns); with sequence parallelism ``seq_len % tp == 0`` (``seq_len``
    defaults to ``model_cfg.seq_len``). The vocabulary need not divide: it is padded.

    Args:
        model_cfg: a :class:`labkit.config.ModelConfig` (``kind="gpt"``).
        tp: tensor-parallel degree.
        sequence_parallel: the residual stream is split along the sequence.
        seq_len: the training sequence length, when not ``model_cfg.seq_len``.

    Raises:
        ValueError: naming the field and the numbers.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if getattr(model_cfg, "kind", "gpt") != "gpt":
        raise ValueError(f"tensor parallelism needs a GPT model, got kind={model_cfg.kind!r}")
    a, k, f = model_cfg.n_heads, model_cfg.kv_heads, model_cfg.ffn_dim
    s = model_cfg.seq_len if seq_len is None else seq_len
    if tp > a:
        raise ValueError(f"tp={tp} is larger than n_heads={a}: every tp rank needs at least "
                         "one query head")
    if a % tp:
        raise ValueError(f"n_heads={a} does not divide by tp={tp}")
    if k >= tp and k % tp:
        raise ValueError(f"kv_heads={k} does not divide by tp={tp}")
    if k < tp and tp % k:
        raise ValueError(f"tp={tp} does not divide by kv_heads={k}: with fewer K/V heads than "
                         "tp ranks each K/V head must serve a whole number of ranks")
    moe = getattr(model_cfg, "n_experts", 0)
    if f % tp and not moe:  # experts are not split over tp (they stay whole on every rank)
        raise ValueError(f"ffn_dim={f} does not divide by tp={tp}")
    if moe and sequence_parallel:
        raise ValueError(f"sequence parallelism with n_experts={moe}: each tp rank's experts "
                         "would see a different slice of the sequence; use "
                         "sequence_parallel=False (the experts stay whole on every tp rank)")
    if sequence_parallel and s % tp:
        raise ValueError(f"sequence parallelism: seq_len={s} does not divide by tp={tp}")
