"""Compositions of the training job for the oracle to check: every dimension a
:class:`~labkit.config.RunConfig` composes, as factors with a few values each.

``pairwise(max_ranks)`` is an all-pairs covering set (every pair of factor values that some
accepted config can hold appears in one);
``random_configs(n, seed, max_ranks)`` draws compositions at random for a longer sweep.
:func:`compose` turns a choice of factor values into a config: knobs of a parallelism that
is off go back to their defaults (``validate`` refuses a knob that has no effect, which
would hide the rest of the composition), and the model gets one layer per pipeline stage.
The model is tiny: ``d_model`` 32, 4 heads of 8, 16 tokens, FFN 64, 4 experts; the ViT
(factor ``model``: ``"vit-cls"``, ``"vit-mean"``) has the same blocks over 8×8 digits in
2×2 patches, is dense and has no embedding to tie (those knobs go back to their defaults:
the oracle's ViT, tests/oracle/vit.py, has neither, so ``ep`` stays 1), and ``validate``
refuses it pipeline parallelism, and cp or sp with a class token: ``accepted`` leaves those
choices out.
"""
from __future__ import annotations

import functools
import random
from labkit.config import ModelConfig, RunConfig

__all__ = ["FACTORS", "PINNED", "compose", "accepted", "pairwise", "random_configs", "label"]

FACTORS: dict = {
    "dp": [1, 2, 4],
    "tp": [1, 2],
    "cp": [1, 2],
    "pp": [1, 2],
    "ep": [1, 2],
    "zero_stage": [0, 1, 2, 3],
    "hsdp_replicas": [1, 2],
    "sequence_parallel": [False, True],
    "cp_method": ["ring", "ulysses", "allgather"],
    "cp_zigzag": [True, False],
    "schedule": ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"],
    "virtual_stages": [2, 3],
    "mlp": ["dense", "top1", "top2", "top1-cap", "top2-cap"],
    "tie_embeddings": [True, False],
    "gqa": [False, True],
    "precision": ["fp32", "bf16"],
    "checkpoint": ["none", "full", "every", "selective"],
    "impl": ["labkit", "torch"],
    "accum": [1, 2],
    # the ViT (tests/oracle/vit.py) trains with dp, tp ± sp and cp only (validate refuses
    # pp and ep for it); "cls" prepends a class token, so cp and sp need "mean"
    "model": ["gpt", "vit-cls", "vit-mean"],
}
NAMES = list(FACTORS)
#: choices run whatever the all-pairs draw holds: an all-pairs set promises no triple, and
#: these once exposed a defect. impl="torch" ZB-V with an MoE: torch pipelining's
#: shape-inference forward counted into step 0's expert loads (labkit.train.pipeline)
PINNED = [dict(dp=1, tp=1, cp=1, pp=2, ep=1, zero_stage=0, hsdp_replicas=1,
               sequence_parallel=False, cp_method="ring", cp_zigzag=True, schedule="zb-v",
               virtual_stages=2, mlp="top1-cap", tie_embeddings=False, gqa=True,
               precision="fp32", checkpoint="none", impl="torch", accum=2, model="gpt")]
#: the factors a ViT ignores (compose sets them back to their defaults)
_NOT_VIT = ("ep", "mlp", "tie_embeddings")
#: schedules that fix the stages per rank (interleaved takes ``virtual_stages``)
_V = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "zb-v": 2, "dualpipe-v": 2}
GLOBAL_BATCH = 8


def compose(choice: dict, steps: int = 2) -> RunConfig:
    """The :class:`RunConfig` of one choice of factor values (``{factor: value}``; a choice
    without ``"model"`` is the GPT's)."""
    c = dict(choice)
    pp, tp, cp, dp, z = c["pp"], c["tp"], c["cp"], c["dp"], c["zero_stage"]
    v = _V.get(c["schedule"], c["virtual_stages"]) if pp > 1 else 1
    vit = c.get("model", "gpt") != "gpt"
    moe, bf16 = c["mlp"] != "dense" and not vit, c["precision"] == "bf16"
    shape = dict(n_layers=max(2, pp * v), d_model=32, n_heads=4,
                 n_kv_heads=2 if c["gqa"] else None, d_ff=64, seq_len=16)
    if vit:  # 8×8 digits in 2×2 patches: 16 patch tokens (17 with the class token)
        mc = ModelConfig(kind="vit", **shape, image_size=8, patch_size=2, n_classes=10,
                         channels=1, vocab_size=10, pool=c["model"][4:], name="matrix-vit")
    else:
        mc = ModelConfig(**shape, tie_embeddings=c["tie_embeddings"], n_experts=4 if moe else 0,
                         # bf16 routes top-2 without a capacity: a top-1 choice or a drop that
                         # bf16 rounding flips at a near-tie moves a whole token to another
                         # expert (measured: one token of 128 flipped, an expert's gradient
                         # 10.7 % off, where the oracle's own bf16 run flipped none), which no
                         # yardstick can bound; top-1 and capacity are checked in fp32
                         top_k=2 if c["mlp"].startswith("top2") or bf16 else 1,
                         capacity_factor=1.0 if c["mlp"].endswith("cap") and not bf16
                         else None, aux_loss_weight=0.01, name="matrix")
    local = GLOBAL_BATCH // dp
    # DualPipeV runs at least one microbatch per stage (M >= 2P): accum counts rounds of 2P
    accum = c["accum"] * (2 * pp if pp > 1 and c["schedule"] == "dualpipe-v" else 1)
    kw = dict(model=mc, parallel=dict(dp=dp, tp=tp, cp=cp, pp=pp, ep=c["ep"] if moe else 1),
              dataset="digits" if vit else "text", steps=steps, global_batch=GLOBAL_BATCH,
              zero_stage=z,
              micro_batch=max(1, local // accum), precision=c["precision"],
              checkpoint=c["checkpoint"], impl=c["impl"],
              adam_eps=1e-6,  # near-zero gradients: see RunConfig.adam_eps
              return_grads=True, return_state=True,
              # PyTorch's ZBVZeroBubble (and ScheduleDualPipeV) calls autograd.grad on a
              # stage input, which torch's MemTracker (labkit.measure.memory) makes fail:
              # validate refuses the memory step there, so the matrix turns it off
              measure_memory=not (c["impl"] == "torch" and pp > 1
                                  and c["schedule"] in ("zb-v", "dualpipe-v")))
    if c["checkpoint"] == "every" and pp == 1:
        kw["checkpoint_every"] = 2  # one segment of both blocks (a pipeline stage has one)
    if z >= 1:
        kw["hsdp_replicas"] = c["hsdp_replicas"] if dp % c["hsdp_replicas"] == 0 else 1
    if tp > 1:
        kw["sequence_parallel"] = c["sequence_parallel"]
    if cp > 1:
        kw.update(cp_method=c["cp_method"], cp_zigzag=c["cp_zigzag"])
    if pp > 1:
        kw.update(schedule=c["schedule"], virtual_stages=v if c["schedule"] == "interleaved"
                  else None)
    return RunConfig(**kw)


def accepted(cfg: RunConfig, max_ranks: int) -> bool:
    """``validate`` accepts ``cfg`` on ``max_ranks`` ranks."""
    try:
        cfg.validate(max_ranks)
        return True
    except ValueError:
        return False


def label(cfg: RunConfig) -> str:
    """A short id: the degrees and every knob that differs from the defaults."""
    p, mc = cfg.parallel, cfg.model_config
    parts = [f"dp{p.dp}tp{p.tp}cp{p.cp}pp{p.pp}ep{p.ep}", f"z{cfg.zero_stage}"]
    if cfg.hsdp_replicas > 1:
        parts.append(f"hsdp{cfg.hsdp_replicas}")
    if cfg.sequence_parallel:
        parts.append("sp")
    if p.cp > 1:
        parts.append(cfg.cp_method + ("-zz" if cfg.cp_zigzag else ""))
    if p.pp > 1:
        parts.append(f"{cfg.schedule}-V{cfg.stages_per_rank}")
    if mc.kind == "vit":
        parts.append(f"vit-{mc.pool}")
    else:
        parts.append(f"top{mc.top_k}{'cap' if mc.capacity_factor else ''}" if mc.n_experts
                     else "dense")
    parts += [s for s, on in (("untied", not mc.tie_embeddings and mc.kind == "gpt"),
                              ("gqa", mc.n_kv_heads),
                              ("bf16", cfg.precision == "bf16"),
                              ("torch", cfg.impl == "torch")) if on]
    if cfg.checkpoint != "none":
        parts.append("ckpt-" + cfg.checkpoint)
    if cfg.accum_steps > 1:
        parts.append(f"acc{cfg.accum_steps}")
    return "-".join(parts)


def pairwise(max_ranks: int = 4, seed: int = 0, tries: int = 80) -> list:
    """An all-pairs covering list of accepted configs on at most ``max_ranks`` ranks.

    Greedy, in the manner of AETG (Cohen et al. 1997): each new config is the best of
    ``tries`` candidates, each built around a pair not yet covered (the other factors drawn
    at random, half of the draws leaning to each factor's first value, so that a pair few
    compositions accept is found) and kept only if ``validate`` accepts it; a pair no
    accepted candidate holds after ``4·tries`` draws counts as impossible (e.g.
    ``impl="torch"`` with ``tp``). A ViT row covers no pair of the knobs it ignores
    (``_NOT_VIT``), so the GPT's pairs of them are covered by GPT rows. Deterministic for a
    ``seed``.
    """
    rng = random.Random(seed)
    m, inert = NAMES.index("model"), [NAMES.index(n) for n in _NOT_VIT]
    pairs = {(i, a, j, b) for i in range(len(NAMES)) for j in range(i + 1, len(NAMES))
             for a in FACTORS[NAMES[i]] for b in FACTORS[NAMES[j]]
             if not (m in (i, j) and {i, j} & set(inert) and "gpt" not in (a, b))}

    def covers(row) -> set:
        # a ViT row holds no pair of the knobs it ignores: they stay for a GPT row to cover
        skip = set(inert) if row[m] != "gpt" else set()
        return {(i, row[i], j, row[j]) for i in range(len(row)) for j in range(i + 1, len(row))
                if i not in skip and j not in skip}

    def draw(pair, lean: bool = False):
        # lean: each other factor at its first value (no parallelism, no knob) half the
        # time, so a pair that few compositions accept (tp with pp, impl="torch") is found
        i, a, j, b = pair
        row = [FACTORS[n][0] if lean and rng.random() < 0.5 else rng.choice(FACTORS[n])
               for n in NAMES]
        row[i], row[j] = a, b
        return tuple(row)

    out, seen, impossible = [], set(), set()
    while pairs - impossible:
        todo = sorted(pairs - impossible, key=repr)
        best, gain = None, 0
        for _ in range(tries):
            pair = rng.choice(todo)
            for k in range(4):
                row = draw(pair, lean=k >= 2)
                if _accepted_row(row, max_ranks):
                    g = len(covers(row) & pairs)
                    if g > gain:
                        best, gain = row, g
                    break
            else:
                if not any(_accepted_row(draw(pair, lean=k % 2 == 1), max_ranks)
                           for k in range(4 * tries)):
                    impossible.add(pair)
        if best is None:
            continue
        pairs -= covers(best)
        cfg = compose(dict(zip(NAMES, best)))
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


@functools.lru_cache(maxsize=None)
def _accepted_row(row: tuple, max_ranks: int) -> bool:
    return accepted(compose(dict(zip(NAMES, row))), max_ranks)


def random_configs(n: int, seed: int, max_ranks: int = 8) -> list:
    """``n`` random choices (accepted or refused, on at most ``max_ranks`` ranks), seeded."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        cfg = compose({k: rng.choice(v) for k, v in FACTORS.items()})
        if cfg.parallel.world_size <= max_ranks:
            out.append(cfg)
    return out




def known_defects(cfg: RunConfig) -> list:
    """The diagnosed labkit defects a composition runs into, as ``(raises, reason)``:
    ``raises`` when the ranks raise, else the run disagrees with the oracle. Empty: it must
    agree."""
    # none open. Fixed, each with its own regression test: a checkpointed ViT's hardware
    # FLOPs left out the recomputation (labkit.train.flops._count); under FSDP2 the ViT's
    # class token and position table, all-gathered by the root's own hook, were measured as
    # activations (labkit.measure.memory: track_own_params); with one image per microbatch
    # the class token's gradient was a view holding the whole sequence's gradient
    # (labkit.models.vit); tensor-parallel bytes of a checkpoint segment of several blocks
    # (labkit.train.comm_predict._tp_predicted), and before them of bf16 autocast's
    # residual side; impl="torch" ZeRO 3 on one data rank (no fully_shard runs) predicted
    # the root's parameters twice (labkit.train.metrics.predicted_memory)
    return []
