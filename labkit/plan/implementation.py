"""What labkit's own training job keeps for backward, beside Megatron-LM's accounting.

:mod:`labkit.plan.activations` counts activations as Megatron-LM keeps them (Korthikanti et
al. 2022). labkit's job (:func:`labkit.train.run`) runs the same algorithms but keeps more
in the places below; each term names the code that keeps it. They were found by listing
the tensors a measured rank held at its activation peak (:mod:`labkit.measure.fake_rank`,
Llama 3 405B at TP 8 × PP 16 × DP 128), and with them the prediction meets the measurement.

Per pipeline rank ``i`` (bytes):

* **kept layers** ``kept · L_i · n_i``: with full recomputation Megatron's ``kept`` (each
  layer's input, which labkit keeps too); without, the rebuilt layer's bytes below;
* **rebuilt layer** :func:`labkit_block_bytes` (Korthikanti's per-layer count plus the
  norms' ``1/rms``) less the layer's input, which the rebuild's first norm saves without
  copying it, and less the residual sum the second norm saves (torch's tracker files it
  as a temporary of the rebuild);
* **stage outputs** ``M · 2·b·(s/cp)·h`` (÷t with SP) for each stage of the rank but the
  model's last;
* **rotary tables** ``n_i · 2 · (s/cp) · (d/2) · 4`` with sequence or context parallelism;
* **output layer** on the last rank: Megatron's fp32 logits term, unchanged;
* **layer working set** (full recomputation): the most temporaries one layer's forward holds
  at once when it saves nothing (:func:`labkit.plan.working_set.layer_working_set`).

With full recomputation a rank's activations peak in one of two places, and the planner
takes the larger: in **backward**, the kept inputs, all stage outputs and the rebuilt
layer (as above); or in the **last forward** in flight, at its last layer, where the kept
inputs are all there, the stage outputs of the flush's earlier microbatches only (this
microbatch's is not made yet), and the running layer's working set stands in place of the
rebuilt layer. With sequence parallelism at large ``t`` the working set is the larger: one
layer's full-sequence matmul outputs (``S·H`` and ``3·S·F/t``) outweigh its saved shards
(Llama 3 405B at TP8: 0.648 GiB against a rebuilt layer's 0.536 GiB).

``L_i`` layers and ``n_i`` microbatches in flight on rank ``i``, ``M`` microbatches per
flush, ``b`` sequences of ``s`` tokens, ``d`` the head size.

* **Stage outputs.** labkit's pipeline executor (:mod:`labkit.parallel.pipeline.executor`)
  keeps a stage's output as the root of that microbatch's backward, and its send is waited
  for only when the flush ends, so every microbatch's output lives until then. Megatron-LM
  frees the output's data as soon as it is sent and keeps only its autograd node
  (``deallocate_output_tensor``; ``deallocate_pipeline_outputs=True`` in its training
  arguments).
* **The rebuilt layer** (full recomputation rebuilds one layer at a time). labkit's block
  keeps, per token and tp rank, what Korthikanti et al. 2022 (§4.1) count for it — each
  RMSNorm's input in the compute dtype, the QKV and MLP inputs (with SP the ``s/t`` shard,
  all-gathered again in backward, §4.2.2), the rotated Q, the K and V heads at their own
  width (SDPA reads each for its group of query heads), SDPA's output, which the projection
  reads as a view, and its fp32 log-sum-exp, SwiGLU's gate, up, silu and product — plus
  each norm's fp32 ``1/rms`` (4 bytes per token, ÷t with SP), which Megatron-LM's fused
  norm keeps too and the paper leaves out: :func:`labkit_block_bytes`, the same terms as
  :func:`labkit.parallel.tensor.activations.block_activation_parts`.
* **Rotary tables.** With sequence or context parallelism the stage's positions are set and
  ``labkit.models.gpt.rope_slice`` indexes the fp32 cos and sin rows per forward; the
  checkpointed layers keep them for their recomputation.

Not modelled here: receive buffers the executor posts ahead of need (they appear in the
measurement as their own role), the batch's token ids, the last rank's output layer, for
which :mod:`labkit.plan.activations`' fp32 logits term stands, and without recomputation
the temporaries a layer holds beyond what it saves (``w2``'s full-sequence output and its
reduction: under 1 % of the 405B rank's activations then).
"""
from __future__ import annotations

from labkit.plan.activations import activation_bytes_per_rank, in_flight
from labkit.plan.working_set import layer_working_set

__all__ = ["labkit_block_bytes", "labkit_activation_terms"]


def labkit_block_bytes(model, b: int, s: int, tp: int = 1, sp: bool = False,
                       act_bytes: int = 2) -> dict:
    """Bytes one block of labkit's GPT saves for backward on one of ``tp`` ranks, for ``b``
    sequences of ``s`` tokens each (the tokens attention sees: ``s/cp`` with context
    parallelism), in ``act_bytes``-byte activations (2: bf16 weights; 4: fp32). SDPA (flash)
    attention, SwiGLU, RMSNorm, grouped-query K/V at their own width; with sequence
    parallelism the column-parallel inputs kept as the ``s/t`` shard (the job re-gathers them
    in backward). Megatron-LM's per-layer count (:mod:`labkit.plan.activations`, no dropout)
    plus each norm's fp32 ``1/rms`` (4 bytes per token): the same terms as
    :func:`labkit.parallel.tensor.activations.block_activation_parts`.

    Returns:
        ``{"norms", "norm statistics", "inputs", "attention", "mlp", "total"}``.

    Raises:
        ValueError: a model labkit's GPT is not (a GELU MLP or eager attention).
    """
    if model.mlp != "swiglu" or model.attention != "flash":
        raise ValueError(f"labkit's GPT has a SwiGLU MLP and SDPA attention, got "
                         f"mlp={model.mlp!r}, attention={model.attention!r}")
    h, f, d, e = model.d_model, model.d_ff, model.head_dim, act_bytes
    a_t = model.n_heads // tp
    kv = int(max(model.kv_dim // tp, d))   # K_T·D: one head each when kv heads < tp
    T = b * s
    local = T // (tp if sp else 1)         # tokens of the residual stream on this rank
    # rotated Q, K, V, the output (also the projection's input: a view); fp32 log-sum-exp
    attention = T * e * (2 * a_t * d + 2 * kv) + T * a_t * 4
    out = {"norms": 2 * local * e * h, "norm statistics": 2 * local * 4,
           "inputs": 2 * local * e * h, "attention": attention,
           "mlp": T * 4 * (f // tp) * e}
    out["total"] = sum(out.values())
    return out


def labkit_activation_terms(model, layout, layers_per_rank: list, act_bytes: int = 2) -> dict:
    """labkit's activation bytes on each pipeline rank, term by term (module docstring).

    Args:
        model: a :class:`~labkit.plan.models.PlanModel`.
        layout: a :class:`~labkit.plan.layout.Layout` (``microbatches`` per flush, full or
            no recomputation).
        layers_per_rank: transformer layers of each pipeline rank.
        act_bytes: bytes of an activation (2 under bf16 autocast, 4 in fp32).

    Returns:
        ``{"per_rank": [{"kept layers", "rebuilt layer", "layer working set", "stage outputs",
        "rotary tables", "output layer", "total"}, …], "megatron":
        activation_bytes_per_rank(...), "working_set": bytes}``: each rank's row is the
        larger of its two candidate peaks (module docstring), with full recomputation
        either the rebuilt layer's (backward) or the working set's (forward).

    Raises:
        ValueError: ``layout.checkpoint`` is ``"selective"`` (labkit's selective policy
            keeps every matmul output; not modelled here).
    """
    if layout.checkpoint == "selective":
        raise ValueError("labkit_activation_terms models checkpoint 'full' and 'none', got "
                         "'selective'")
    mega = activation_bytes_per_rank(model, layout, layers_per_rank)
    s = layout.seq_len or model.seq_len
    s_local, t, sp, b = s // layout.cp, layout.tp, layout.sp, layout.microbatch
    block = labkit_block_bytes(model, b, s_local, t, sp, act_bytes)["total"]
    boundary = b * (s_local // (t if sp else 1)) * model.d_model * act_bytes
    # the first norm saves the layer input itself, already kept: no new storage; the second
    # norm's input, the residual sum the block computes between its children, is rebuilt
    # too, but torch's MemTracker files what a checkpointed block computes outside its
    # children during the rebuild as temporaries, not activations (measured)
    rebuilt = block - 2 * boundary
    rope = 2 * s_local * (model.head_dim // 2) * 4 if (sp or layout.cp > 1) else 0
    p = layout.pp
    head = (4 * b * s_local * model.vocab_size / t
            + 2 * b * s_local * model.d_model / (t if sp else 1))
    v = layout.virtual_stages
    kept = boundary if layout.checkpoint == "full" else block  # per layer and microbatch
    # full recomputation: the last forward in flight runs its layers without saving; at its
    # last layer the rank holds every kept input and that layer's working set of temporaries
    # (labkit.plan.working_set), and the stage outputs of the flush's earlier microbatches
    # only (this one's is not made yet)
    ws = layer_working_set(model, b, s_local, t, sp, act_bytes)["bytes"] \
        if layout.checkpoint == "full" else 0.0
    out = []
    for i in range(p):
        n = in_flight(layout.schedule, p, layout.microbatches, i, v)
        # each of the rank's V stages but the model's last keeps all M of its outputs
        outputs = (v - (i == p - 1)) * layout.microbatches * boundary if p > 1 else 0
        row = {"kept layers": kept * layers_per_rank[i] * n,
               "rebuilt layer": rebuilt if layout.checkpoint == "full" else 0.0,
               "layer working set": 0.0,
               "stage outputs": outputs,
               "rotary tables": n * rope,
               "output layer": head if i == p - 1 else 0.0}
        row["total"] = sum(row.values())
        fwd = dict(row, **{"rebuilt layer": 0.0, "layer working set": ws, "output layer": 0.0,
                           "stage outputs": outputs - (boundary if 0 < outputs and i < p - 1
                                                       else 0)})
        fwd["total"] = sum(v_ for k, v_ in fwd.items() if k != "total")
        out.append(fwd if fwd["total"] > row["total"] else row)
    return {"per_rank": out, "megatron": mega, "working_set": ws}
