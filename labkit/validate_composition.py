"""The composition rules of :func:`labkit.validate.validate_run` (its rule 6): a field the
composition cannot honour is refused, never ignored; ``noise_scale`` where it is not yet
measured; and what the ranks themselves would refuse or fail on, refused before launch.

Each raises a plain ``ValueError`` naming the field(s) and the numbers.
"""
from __future__ import annotations

from .validate_common import _refuse_unless


def _noise_scale(cfg, mc) -> None:
    """``noise_scale=True`` reads the local gradient before the reduction and the reduced
    one after it (:mod:`labkit.train.noise_scale`): where a rank's gradient is not one
    data replica's whole-model gradient, or no rank holds it, the two norms would be of
    something else, so the compositions not yet measured are refused."""
    if not cfg.noise_scale:
        return
    p = cfg.parallel
    why = None
    if p.dp < 2:
        why = (f"it compares each data rank's local gradient with the all-reduced one, and "
               f"dp={p.dp} gives one batch size only")
    elif cfg.zero_stage >= 2:
        why = (f"zero_stage={cfg.zero_stage} drops each unit's full local gradient once its "
               "reduce-scatter completes inside backward; measured at zero_stage 0 and 1")
    elif cfg.hsdp_replicas > 1:
        why = (f"hsdp_replicas={cfg.hsdp_replicas} reduces over two groups; measured with one "
               "shard group over all data ranks")
    elif cfg.impl != "labkit":
        why = "PyTorch's DDP reduces inside backward, so no local gradient is left to read"
    elif p.tp > 1 or p.pp > 1 or p.cp > 1:
        why = (f"a rank holds part of the model or of the sequence (tp={p.tp}, pp={p.pp}, "
               f"cp={p.cp}); measured with pure data parallelism only")
    elif mc.n_experts:
        why = (f"a mixture of experts (n_experts={mc.n_experts}) reduces its experts over "
               "another group; measured for dense models only")
    if why:
        raise ValueError(f"noise_scale=True cannot be honoured: {why}")


def _composition(cfg, mc) -> None:
    p, z = cfg.parallel, cfg.zero_stage
    _refuse_unless(cfg, p.pp > 1, ("schedule", "microbatches", "virtual_stages"),
                   "it is a pipeline setting and pp=1")
    _refuse_unless(cfg, p.tp > 1, ("sequence_parallel",), "sequence parallelism needs tp > 1")
    _refuse_unless(cfg, p.cp > 1, ("cp_method", "cp_zigzag"), "context parallelism is off (cp=1)")
    _refuse_unless(cfg, z >= 1, ("hsdp_replicas",), "HSDP needs zero_stage 1-3 (stage 0 is "
                   "plain data parallelism over all data ranks)")
    _refuse_unless(cfg, z == 3, ("prefetch", "keep_last"), "it is a ZeRO-3/FSDP setting and "
                   f"zero_stage={z}")
    _refuse_unless(cfg, z == 0, ("dp_mode", "find_unused"), f"zero_stage={z} shards with "
                   "flat units (they reduce zeros for unused parameters themselves)")
    _refuse_unless(cfg, z == 0 and cfg.dp_mode == "ddp", ("bucket_mb",),
                   "buckets exist only in dp_mode='ddp' at zero_stage=0")
    _refuse_unless(cfg, p.dp * p.cp > 1, ("dp_mode", "bucket_mb"),
                   f"there is one data rank (dp x cp = {p.dp} x {p.cp} = 1): no gradient is "
                   "reduced across ranks")
    _noise_scale(cfg, mc)
    _refuse_unless(cfg, cfg.checkpoint == "every", ("checkpoint_every",),
                   f"it sets the segment length of checkpoint='every' (got {cfg.checkpoint!r})")
    if p.pp > 1 and z >= 1 and cfg.schedule in ("zb-h1", "zb-v", "dualpipe-v"):
        raise ValueError(f"schedule={cfg.schedule!r} with zero_stage={z}: the zero-bubble W "
                         "pass writes weight gradients outside autograd, but ZeRO's flat units "
                         "collect them through autograd; use zero_stage=0 or another schedule")
    if (p.pp > 1 and z >= 1 and cfg.precision == "bf16" and mc.kind == "gpt"
            and mc.tie_embeddings):
        raise ValueError(f"zero_stage={z} with pp={p.pp}, precision='bf16' and a tied "
                         "embedding: the tied copy stays outside the bf16 flat units (its two "
                         "copies are summed across stages first), so the head would mix fp32 "
                         "and bf16; use tie_embeddings=False, precision='fp32' or zero_stage=0")
    if cfg.impl == "torch":
        used = [name for name, on in (("data parallelism", p.dp > 1 or z > 0),
                                      ("pipeline parallelism", p.pp > 1),
                                      ("tensor parallelism", p.tp > 1),
                                      ("context parallelism", p.cp > 1)) if on]
        if len(used) != 1 or p.cp > 1 or p.tp > 1:
            raise ValueError(f"impl='torch' runs PyTorch's own version of ONE parallelism "
                             f"(DDP, FSDP2 or pipelining) as a reference; this run uses "
                             f"{' and '.join(used) or 'none'} (PyTorch's tensor parallelism "
                             "is compared in tests/test_tensor_parallel.py; its context "
                             "parallelism does not run on CPU)")
        if p.ep > 1:
            # DDP would broadcast rank 0's experts over the others' and average different
            # experts; FSDP2 would shard each rank's expert slice as if it were replicated
            raise ValueError(f"impl='torch' with ep={p.ep}: PyTorch's DDP and FSDP2 treat "
                             f"every parameter as replicated over the {p.dp} data ranks, but "
                             f"each rank holds {mc.n_experts // p.ep} of the {mc.n_experts} "
                             "experts of a layer; use ep=1 or impl='labkit'")
        if z in (1, 2):
            raise ValueError(f"impl='torch' has no ZeRO-{z}: PyTorch's references are DDP "
                             "(zero_stage=0) and FSDP2 fully_shard (zero_stage=3)")
        if z == 0 and cfg.dp_mode != "ddp":
            raise ValueError("impl='torch' at zero_stage=0 is PyTorch DDP; dp_mode must be 'ddp'")
        if cfg.compile or cfg.checkpoint != "none" or cfg.precision != "fp32":
            raise ValueError("impl='torch' is a plain fp32 reference: compile, checkpoint and "
                             "precision stay at their defaults")
    if cfg.compile and z == 3:
        raise ValueError("compile=True with zero_stage=3: labkit's FSDP re-installs parameter "
                         "views on every forward, which torch.compile would re-trace; use "
                         "zero_stage 0-2")


def _rank_limits(cfg) -> None:
    """What the ranks themselves would refuse or fail on, refused here first (found by the
    generated configs of tests/test_validate_property.py)."""
    p, z = cfg.parallel, cfg.zero_stage
    data_ranks = p.dp * p.cp
    if z == 3 and cfg.checkpoint == "every" and cfg.checkpoint_every > 1 and data_ranks > 1:
        raise ValueError(f"zero_stage=3 with checkpoint='every' and checkpoint_every="
                         f"{cfg.checkpoint_every}: a segment's first block recomputes all "
                         f"{cfg.checkpoint_every} of its blocks, but each ZeRO-3 unit is one "
                         "block and gathers its parameters only when its own forward runs; "
                         "use checkpoint_every=1, checkpoint='full' or 'selective', or "
                         "zero_stage 0-2")
    if cfg.impl == "torch" and z == 3 and cfg.hsdp_replicas > 1 and cfg.hsdp_replicas == p.dp:
        raise ValueError(f"impl='torch' with hsdp_replicas={cfg.hsdp_replicas} = dp={p.dp}: "
                         "every replica would be one shard, and PyTorch's FSDP2 mesh "
                         "(replicate, shard) is built here with a shard degree > 1; use "
                         "hsdp_replicas < dp or impl='labkit'")
