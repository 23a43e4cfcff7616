"""The model-parallel part of composing a rank's stages (DESIGN.md §9), in the order
:func:`labkit.train.build.build_rank` applies it: the pipeline split (and the zero-bubble
weight-gradient store), the tied embedding summed across pipeline ranks, tensor/sequence,
context and expert parallelism, and activation checkpointing. Each step edits the
:class:`~labkit.train.rank_setup.RankSetup` in place and is a no-op when its degree is 1.
"""
from __future__ import annotations

from torch import nn

from .rank_setup import RankSetup


def _split_pipeline(setup: RankSetup, model: nn.Module) -> None:
    from ..parallel.pipeline.stage import StageModule, WeightGradStore, _swap_linears

    cfg, mg = setup.cfg, setup.mg
    if cfg.parallel.pp == 1:
        setup.stages = {0: StageModule(model, 0, 1)}
        return
    sched = cfg.build_schedule()
    pp_index = mg.index("pp")
    setup.schedule = sched
    setup.stages = {s: StageModule(model, s, sched.n_stages) for s in sched.stages_of(pp_index)}
    if sched.split_backward and cfg.impl != "torch":  # PyTorch's ZBV splits B/W itself
        setup.store = WeightGradStore()
        for m in setup.stages.values():
            _swap_linears(m, setup.store)


def _tie_across_stages(setup: RankSetup) -> None:
    """The tied embedding's two copies (first and last stage, on different pipeline ranks)
    are summed before any data-parallel reduction — taken after tensor parallelism, whose
    vocabulary shards are the parameters that train."""
    cfg, mg = setup.cfg, setup.mg
    if setup.schedule is None:
        return
    from ..parallel.pipeline.stage import TiedEmbedding

    setup.tied = TiedEmbedding(cfg.model_config, setup.schedule, mg.index("pp"), setup.stages,
                               mg.group("pp"), pp_ranks=mg.ranks("pp"))


def _tensor_parallel(setup: RankSetup) -> None:
    """Each stage sliced to this rank's tensor-parallel shard (Shoeybi et al. 2019 §3;
    Korthikanti et al. 2022 for sequence parallelism): column/row-parallel attention and
    SwiGLU, vocab-parallel embedding, head and cross-entropy. Every tp rank computes the same
    loss and ends backward with complete gradients for its shard. With sequence parallelism
    the column-parallel inputs are re-gathered in backward (``regather``)."""
    cfg, mg = setup.cfg, setup.mg
    if cfg.parallel.tp == 1:
        return
    from ..parallel.tensor import apply_tensor_parallel

    seq = cfg.model_config.seq_len // cfg.parallel.cp  # what attention sees on this rank
    for m in setup.stages.values():
        # with SP, column-parallel matmuls keep the S/T shard and re-gather it in backward,
        # as Megatron-LM does (Korthikanti et al. 2022 §4.2.2; claim C18)
        setup.tp_info = apply_tensor_parallel(m, mg.group("tp"),
                                              sequence_parallel=cfg.sequence_parallel,
                                              regather=cfg.sequence_parallel, seq_len=seq)
    _retie_vocab_shard(setup)


def _retie_vocab_shard(setup: RankSetup) -> None:
    """A V schedule (zb-v, dualpipe-v) puts the first and the last stage on one rank, where
    the tied head *is* the embedding Parameter — but tensor parallelism converts each stage
    on its own, so each would get its own vocabulary shard and the tie would silently break
    (the head's gradient never reaching ``tok_emb.weight``, and no :class:`TiedEmbedding`
    exchange either, as both stages share a rank). Both shards hold the same rows
    ``[rank·V'/T, (rank+1)·V'/T)`` of the same table, so the head takes the embedding's."""
    if not setup.cfg.model_config.tie_embeddings or setup.schedule is None:
        return
    first, last = 0, setup.schedule.n_stages - 1
    if first in setup.stages and last in setup.stages:
        emb, head = setup.stages[first].tok_emb, setup.stages[last].head
        head.weight = emb.weight


def _context_parallel(setup: RankSetup) -> None:
    """Every block's attention runs the context-parallel core over the ``cp`` group, and
    rotary positions follow this rank's (zigzag) share of the sequence (Liu et al. 2023;
    Jacobs et al. 2023; Dubey et al. 2024 §3.3.2)."""
    cfg, mg = setup.cfg, setup.mg
    if cfg.parallel.cp == 1:
        return
    from ..parallel.context import make_attention_core, positions

    mc = cfg.model_config
    core = make_attention_core(cfg.cp_method, mg.group("cp"), causal=True,
                               zigzag=cfg.cp_zigzag, seq_len=mc.seq_len)
    pos = positions(mg.index("cp"), cfg.parallel.cp, mc.seq_len, cfg.cp_zigzag,
                    device=setup.device)
    for m in setup.stages.values():
        m.positions = pos
        for block in m.layers:
            block.attn.core = core
    setup.cp_core = core


def _expert_parallel(setup: RankSetup) -> None:
    """Mixture-of-experts layers: each forward's load-balancing loss enters the objective by
    its share of the global batch (the one loss rule), and with ``ep > 1`` each rank keeps
    ``E/ep`` experts of every layer, tokens reaching them by all-to-all (Lepikhin et al.
    2020, GShard §2; Fedus et al. 2021, Switch §2.2)."""
    cfg, mg = setup.cfg, setup.mg
    if not cfg.model_config.n_experts:
        return
    from ..models.moe import set_aux_loss_scale

    p = cfg.parallel
    # PyTorch's DDP and FSDP2 average over the data ranks: like the token loss (step.py's
    # grad_scale), the aux loss is multiplied by their number so the average undoes it
    averaged = mg.size("dp_cp") if cfg.impl == "torch" else 1
    for m in setup.stages.values():  # one forward = one microbatch of S/cp tokens
        set_aux_loss_scale(m, averaged * cfg.micro / (cfg.global_batch * p.cp))
    if p.ep == 1:
        return
    from ..parallel.expert import apply_expert_parallel, expert_parameters

    for m in setup.stages.values():
        apply_expert_parallel(m, mg.group("ep"))
        setup.expert_params += [q for _, q in expert_parameters(m)]


def _checkpoint(setup: RankSetup) -> None:
    cfg = setup.cfg
    if cfg.checkpoint == "none":
        return
    from ..parallel.checkpoint.policy import apply_checkpoint_policy

    for m in setup.stages.values():
        apply_checkpoint_policy(m, cfg.checkpoint, cfg.checkpoint_every)
