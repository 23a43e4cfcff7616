"""Every composition of the training job against an oracle that shares no code with labkit's
model or parallelism (tests/oracle): an all-pairs covering set of the dimensions (dp, ZeRO
0-3, HSDP, tp ± sp, cp × method × zigzag, pp × schedule (DualPipeV included) × virtual
stages, ep, tied/untied, GQA, dense/top-1/top-2/capacity, fp32/bf16, checkpoint policies,
impl, accumulation, and the model: the GPT or the ViT with class-token or mean pooling,
held against tests/oracle/vit.py), each run on the cluster and checked on every rank:
losses, first-step gradients before the optimizer, final parameters, routing counts and aux
loss, FLOPs (model and recomputed) per data replica, every
axis's predicted bytes per collective against the bytes its traced calls moved, and each
rank's measured model state (parameters, gradients, optimizer) against the job's prediction
and the planner's (whose differences the job states in words, ``memory_planned["note"]``).
``validate`` accepting a config means the ranks must run it. Compositions that meet a
diagnosed defect are strict xfails naming it (tests/oracle/matrix.py ``known_defects``).
Layout invariance: the same global batch and seed give the same losses, gradients,
total FLOPs and total measured model state (replicas counted once) in every layout. The longer random sweep is ``make sweep``."""
from __future__ import annotations

import pytest
import torch
from oracle.check import disagreements
from oracle.matrix import PINNED, compose, known_defects, label, pairwise

from labkit import jobs
from labkit.cluster import RankError

pytestmark = pytest.mark.distributed

CASES = pairwise(max_ranks=4)
CASES += [c for c in map(compose, PINNED) if c not in CASES]


def _param(cfg):
    """A case; one that meets a diagnosed defect is a strict xfail that only the failure
    the defect causes satisfies (a rank raising, or a disagreement), so a second, new
    failure of the other kind still fails the test."""
    known = known_defects(cfg)
    marks = []
    if known:
        raises = pytest.fail.Exception if any(r for r, _ in known) else AssertionError
        marks = [pytest.mark.xfail(strict=True, raises=raises,
                                   reason="; ".join(why for _, why in known))]
    return pytest.param(cfg, id=label(cfg), marks=marks)


def test_matrix_covers_every_value():
    """Each value of each factor is in some case (the all-pairs set holds every pair a
    valid config can, so every single value too)."""
    assert 25 <= len(CASES) <= 55
    seen = {(p.dp, p.tp, p.cp, p.pp, p.ep) for p in (c.parallel for c in CASES)}
    assert any(s[0] == 4 for s in seen) and all(any(s[i] == 2 for s in seen) for i in range(1, 5))
    got = {(c.zero_stage, c.precision, c.checkpoint, c.impl) for c in CASES}
    for i, values in enumerate(([0, 1, 2, 3], ["fp32", "bf16"],
                                ["none", "full", "every", "selective"], ["labkit", "torch"])):
        assert {g[i] for g in got} == set(values)
    assert {c.schedule for c in CASES if c.parallel.pp > 1} == \
        {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"}
    vit = [c for c in CASES if c.model_config.kind == "vit"]
    assert {c.model_config.pool for c in vit} == {"cls", "mean"}
    assert any(c.parallel.tp > 1 for c in vit) and any(c.parallel.cp > 1 for c in vit)
    assert {c.cp_method for c in CASES if c.parallel.cp > 1} == {"ring", "ulysses", "allgather"}


@pytest.mark.parametrize("cfg", [_param(c) for c in CASES])
def test_composition_matches_oracle(cluster4, cfg):
    try:
        result = cluster4.run(jobs.train, cfg)
    except RankError as e:  # validate accepted it, so the ranks must run it
        pytest.fail(f"validate accepts {label(cfg)} but a rank raised: {str(e)[:400]}")
    bad = disagreements(result, cfg)
    assert not bad, "\n".join(bad)


LAYOUTS = [dict(dp=4), dict(dp=2, tp=2, sequence_parallel=True),
           dict(dp=1, cp=2, pp=2, cp_method="ulysses", schedule="1f1b"),
           dict(dp=2, pp=2, zero_stage=1, schedule="gpipe")]


@pytest.fixture(scope="module")
def layouts(cluster4):
    out = []
    for kw in LAYOUTS:
        choice = dict(dp=1, tp=1, cp=1, pp=1, ep=1, zero_stage=0, hsdp_replicas=1,
                      sequence_parallel=False, cp_method="ring", cp_zigzag=True,
                      schedule="1f1b", virtual_stages=2, mlp="dense", tie_embeddings=True,
                      gqa=True, precision="fp32", checkpoint="none", impl="labkit", accum=1)
        choice.update(kw)
        cfg = compose(choice, steps=1)
        out.append((cfg, cluster4.run(jobs.train, cfg)))
    return out


def test_layout_invariance(layouts):
    """One global batch and seed, four layouts: the same loss and first-step gradients on
    every rank (fp32, 1e-5)."""
    (_, first), *rest = layouts
    want_loss, want = first.losses, first.outputs[0]["grads"]
    for cfg, r in rest:
        assert r.losses == pytest.approx(want_loss, abs=1e-5), label(cfg)
        for o in r.outputs:
            for name, g in o["grads"].items():
                torch.testing.assert_close(g, want[name], atol=1e-5, rtol=0, msg=name)


def test_layout_invariance_of_total_flops(layouts):
    """The FLOPs of a step summed over all ranks do not depend on the layout."""
    totals = {label(cfg): sum(m["flops_per_step"] for m in r.metrics) for cfg, r in layouts}
    assert len(set(totals.values())) == 1, totals


def total_model_state(result, cfg) -> dict:
    """Model-state bytes of the whole run by category, replicas counted once, from the
    MEASURED state of every rank (``metrics["memory"]["model_state"]``).

    The rule, per mesh axis, for category ``c`` (parameters, gradients, optimizer):

    * ``dp_replicate`` (HSDP replicas) holds copies: only replica index 0 counts;
    * ``dp_shard × cp`` (the ZeRO shard group): ZeRO-``z`` shards the optimizer state
      (``z ≥ 1``), the gradients (``z ≥ 2``), the parameters (``z = 3``) — a sharded ``c``
      counts on every shard rank, an unsharded one on index 0 only (the flat units'
      padding to a multiple of ``K`` would not be model state: the layouts here pad none,
      which the test checks by the job's own words for it); what ZeRO keeps outside its
      flat units (``metrics["replicated_params"]``: a tied copy between pipeline stages) is
      whole on every shard rank, so counts on index 0 only;
    * ``tp`` splits the matrices: every tp rank counts, less ``(T − 1)`` copies of what each
      tp rank holds whole (the norm weights, ``H`` each: two per block and the final one);
    * ``pp`` partitions the layers: every stage counts, less the tied embedding's copy on
      the last stage (``V·H``) when ``pp > 1`` and the embedding is tied;
    * AdamW's step counters (4 bytes per tensor stepped: flat units change their number) are
      bookkeeping, not model state: taken off the optimizer state.
    """
    mc, p, z = cfg.model_config, cfg.parallel, cfg.zero_stage
    sharded = {"optimizer": z >= 1, "gradients": z >= 2, "parameters": z >= 3}
    per = {"parameters": 4, "gradients": 4, "optimizer": 8}  # fp32 bytes per element
    out = dict.fromkeys(per, 0)
    for m in result.metrics:
        coords, got = m["coords"], m["memory"]["model_state"]
        if coords.get("dp_replicate", 0):
            continue
        first = not (coords.get("dp_shard", 0) or coords.get("cp", 0))
        for c in per:
            if sharded[c] or first:
                out[c] += got[c] - (4 * m["optimizer_state_tensors"] if c == "optimizer" else 0)
            if sharded[c] and not first:  # kept outside the flat units: whole on each
                out[c] -= m["replicated_params"] * per[c]
    norms = (2 * mc.n_layers + 1) * mc.d_model
    tied = mc.vocab_size * mc.d_model if (mc.tie_embeddings and p.pp > 1) else 0
    for c, b in per.items():
        out[c] -= ((p.tp - 1) * norms + tied) * b
    out["total"] = sum(out.values())
    return out


def test_layout_invariance_of_total_model_state(layouts):
    """The measured model state of the whole run, replicas counted once
    (:func:`total_model_state`), is the same in every layout: 16 bytes per parameter, fp32."""
    assert not any("padded" in (m["memory_planned"]["note"] or "")
                   for _, r in layouts for m in r.metrics)
    totals = {label(cfg): total_model_state(r, cfg) for cfg, r in layouts}
    n = layouts[0][1].metrics[0]["n_params"]
    want = {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n, "total": 16 * n}
    assert all(t == want for t in totals.values()), (want, totals)
