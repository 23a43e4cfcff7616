"""Expert parallelism: parity with the dense single-process MoE on every rank (including
routings where an expert gets no token and ranks send very different counts), the same
tokens dropped under a capacity factor, EP x DP training, exact all-to-all bytes from the
trace against the formula from the counts, expert memory divided by ep, and bad input."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from jobs_expert import A2A_SIZES, PATTERNS, LayerCase, a2a_v, build_case, layer_step

from labkit.config import PRESETS
from labkit.models.moe import record_routing, set_token_groups
from labkit.parallel.expert import (a2a_bytes_formula, a2a_bytes_from_trace,
                                    check_expert_parallel)
from labkit.parallel.expert.jobs import ExpertRunConfig, reference, train

pytestmark = pytest.mark.distributed
TOL = 1e-5


def dense_reference(case: LayerCase) -> dict:
    """The same layer on all ``P·T`` tokens in one process, token groups = the ranks."""
    layer, x, target = build_case(case)
    set_token_groups(layer, case.ep)
    x = x.clone().requires_grad_(True)
    with record_routing(layer) as log:
        y = layer(x)
    loss = (y * target).sum() / (case.ep * case.tokens)
    loss.backward()
    st = log[0]
    return {"y": y.detach(), "x_grad": x.grad, "router_grad": layer.router.weight.grad,
            "loss": loss.item(), "counts": st.counts.tolist(), "kept": st.kept.tolist(),
            "dropped": st.dropped.tolist(), "aux": st.aux_per_group.tolist(),
            "expert_grads": {n: getattr(layer.experts, n).grad for n in ("w1", "w3", "w2")}}


def check_layer_parity(cluster, case: LayerCase) -> tuple:
    r = cluster.run(layer_step, case, nranks=case.ep)
    ref = dense_reference(case)
    t = case.tokens
    for rank, out in enumerate(r.outputs):  # every rank, never rank 0 only
        assert out["loss"] == pytest.approx(ref["loss"], abs=TOL)
        assert out["counts"] == ref["counts"][rank] and out["kept"] == ref["kept"][rank]
        assert out["aux"] == pytest.approx(ref["aux"][rank], abs=1e-6)
        torch.testing.assert_close(out["y"], ref["y"][rank], atol=TOL, rtol=0)
        torch.testing.assert_close(out["x_grad"], ref["x_grad"][rank], atol=TOL, rtol=0)
        torch.testing.assert_close(out["router_grad"], ref["router_grad"], atol=TOL, rtol=0)
        lo, n = out["first"], out["n_local"]
        for name, g in out["expert_grads"].items():
            torch.testing.assert_close(g, ref["expert_grads"][name][lo:lo + n], atol=TOL, rtol=0)
        # the same (token, slot) choices dropped: rank r's token i is global token r·T + i
        mine = sorted((rank * t + i, s) for i, s in out["dropped"])
        theirs = sorted((i, s) for i, s in ref["dropped"] if rank * t <= i < (rank + 1) * t)
        assert mine == theirs
    return r, ref


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("ep", [2, 4])
def test_layer_parity_without_dropping(cluster4, ep, top_k, pattern):
    case = LayerCase(ep=ep, top_k=top_k, pattern=pattern)
    r, ref = check_layer_parity(cluster4, case)
    per_expert = [sum(row[e] for row in ref["counts"]) for e in range(case.n_experts)]
    # the forced routings really are what they claim
    sent_away = [sum(c for e, c in enumerate(o["kept"])
                     if not o["first"] <= e < o["first"] + o["n_local"]) for o in r.outputs]
    if pattern == "starved":
        assert per_expert[-1] == 0 and min(per_expert[:-1]) > 0
    if pattern == "skewed":
        assert sent_away[0] == 0 and sent_away[-1] >= case.tokens * top_k // 2
    if pattern == "collapsed":
        assert sum(per_expert[2:]) == 0  # experts 0 and 1 live on rank 0
        assert all(sum(map(sum, o["recv"])) == 0 for o in r.outputs[1:])
    assert not any(o["dropped"] for o in r.outputs)


@pytest.mark.parametrize("ep,top_k,pattern,cf", [(2, 1, "natural", 1.0), (2, 2, "skewed", 0.5),
                                                 (4, 2, "natural", 0.75),
                                                 (4, 1, "collapsed", 1.25)])
def test_layer_parity_with_capacity_drops_the_same_tokens(cluster4, ep, top_k, pattern, cf):
    case = LayerCase(ep=ep, top_k=top_k, pattern=pattern, capacity_factor=cf)
    r, ref = check_layer_parity(cluster4, case)
    assert ref["dropped"] and sum(len(o["dropped"]) for o in r.outputs) == len(ref["dropped"])


def test_activation_checkpointing_recomputes_the_dispatch_without_recording_it_twice(cluster4):
    case = LayerCase(ep=2, top_k=2, pattern="skewed", capacity_factor=0.75, checkpoint=True)
    r, _ = check_layer_parity(cluster4, case)
    for rank in range(2):
        passes = {k[1:] for k in a2a_bytes_from_trace(r.trace.events, rank=rank)}
        assert passes == {(ph, p) for ph in ("counts", "dispatch", "combine")
                          for p in ("forward", "recompute")} | {("dispatch", "backward"),
                                                                ("combine", "backward")}
        traced = a2a_bytes_from_trace(r.trace.events, rank=rank)
        assert traced[(None, "dispatch", "recompute")] == traced[(None, "dispatch", "forward")]


def test_all_to_all_v_moves_uneven_and_empty_splits_with_exact_bytes(cluster4):
    r = cluster4.run(a2a_v, None)
    sizes = A2A_SIZES
    for me, out in enumerate(r.outputs):
        want = [[100 * src + i for i in range(sizes[src][me])] for src in range(4)]
        assert out["rows"] == [v for w in want for v in w]
        ev = [e for e in r.trace.events if e.rank == me and e.op == "all_to_all"]
        row = 3 * 4  # three float32 per row
        assert ev[0].bytes_sent == sum(s for j, s in enumerate(sizes[me]) if j != me) * row
        assert ev[0].bytes_recv == sum(sizes[j][me] for j in range(4) if j != me) * row
        assert ev[0].args["bytes_to"] == [0 if j == me else s * row
                                          for j, s in enumerate(sizes[me])]


# ------------------------------------------------------------------ the standalone training job

def _assert_close_state(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want)
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        assert diff < TOL, f"{what} {name}: {diff}"


@pytest.mark.parametrize("ep,dp,model,opt", [
    (2, None, "tiny-moe", "sgd"),
    (4, None, "tiny-moe", "adamw"),
    (2, 4, "tiny-moe", "sgd"),                                     # EP x DP: edp groups of 2
    (2, None, dataclasses.replace(PRESETS["tiny-moe"], top_k=1, capacity_factor=1.0), "sgd"),
])
def test_training_parity_on_every_rank(cluster4, ep, dp, model, opt):
    # plain SGD keeps a wrong gradient scale visible; AdamW at its usual rate (at 5e-2 its
    # first step, about lr·sign(g), turns fp32 noise in near-zero gradients into 1e-4)
    cfg = ExpertRunConfig(model=model, ep=ep, dp=dp, steps=3, optimizer=opt,
                          lr=0.05 if opt == "sgd" else 1e-3, return_state=True)
    r = cluster4.run(train, cfg)
    ref = reference(cfg)
    n = cfg.data_ranks
    assert len(r.outputs) == n
    for s in range(cfg.steps):
        assert sum(o["losses"][s] for o in r.outputs) == pytest.approx(ref["losses"][s], abs=TOL)
    for rank, out in enumerate(r.outputs):
        _assert_close_state(out["grads0"], ref["grads0"], f"rank {rank} grad")
        _assert_close_state(out["state"], ref["state"], f"rank {rank} param")
        for mine, theirs in zip(out["routing"], ref["routing"]):  # per step
            for layer in range(2):
                assert mine["counts"][layer] == theirs["counts"][layer][rank]
                assert mine["kept"][layer] == theirs["kept"][layer][rank]
        t = cfg.global_batch // n * cfg.model_config.seq_len  # tokens per data rank
        for layer in range(2):
            mine = sorted((rank * t + i, sl) for i, sl in out["dropped_idx"][layer])
            assert mine == sorted((i, sl) for i, sl in ref["dropped_idx"][layer]
                                  if rank * t <= i < (rank + 1) * t)


@pytest.mark.parametrize("ep,dp", [(2, None), (4, None), (2, 4)])
def test_all_to_all_bytes_equal_the_formula_from_the_counts(cluster4, ep, dp):
    cfg = ExpertRunConfig(ep=ep, dp=dp, steps=2,
                          model=dataclasses.replace(PRESETS["tiny-moe"], capacity_factor=1.0))
    r = cluster4.run(train, cfg)
    for rank, out in enumerate(r.outputs):
        block = rank // ep  # the ep group: consecutive blocks of ep data ranks
        peers = r.outputs[block * ep:(block + 1) * ep]
        for s in range(cfg.steps):
            traced = a2a_bytes_from_trace(r.trace.events, rank=rank, step=s)
            for layer in range(2):
                kept = [o["routing"][s]["kept"][layer] for o in peers]
                want = a2a_bytes_formula(kept, rank - block * ep, out["d_model"],
                                         out["elem_bytes"])
                got = {k: v for k, v in traced.items() if k[0] == layer}
                assert got[(layer, "dispatch", "forward")][0] == want["dispatch_sent"]
                assert got[(layer, "dispatch", "forward")][1] == want["dispatch_recv"]
                assert got[(layer, "combine", "forward")][0] == want["combine_sent"]
                assert got[(layer, "combine", "backward")][0] == want["combine_recv"]
                assert got[(layer, "dispatch", "backward")][0] == want["dispatch_recv"]
                assert got[(layer, "counts", "forward")][0] == want["counts_sent"]
                assert sum(v[0] for v in got.values()) == want["sent"]
                assert sum(v[1] for v in got.values()) == want["recv"]
    assert any(o["routing"][0]["dropped"] != [0, 0] for o in r.outputs)  # drops are not sent


def test_expert_memory_is_divided_by_ep(cluster4):
    mc = PRESETS["tiny-moe"]
    full = mc.n_layers * mc.n_experts * 3 * mc.d_model * mc.ffn_dim * 4
    dense = 0
    for ep in (2, 4):
        r = cluster4.run(train, ExpertRunConfig(ep=ep, steps=2, measure_memory=True))
        for out in r.outputs:
            info = out["info"]
            assert info["expert_bytes"] == full // ep  # storage accounting, the slice only
            assert info["full_expert_numel"] * 4 == full
            dense = out["param_bytes"] - info["expert_bytes"]
            assert out["param_bytes"] == dense + full // ep
            # torch's MemTracker sees the same parameter bytes on every rank
            assert out["memory"]["parameters"] == dense + full // ep
    from labkit.models import count_params
    assert dense + full == count_params(mc) * 4


def test_bad_layouts_raise_before_any_rank_starts():
    moe = PRESETS["tiny-moe"]
    with pytest.raises(ValueError, match="n_experts=4 is not divisible by ep=3"):
        check_expert_parallel(moe, 3, 6)
    with pytest.raises(ValueError, match=r"ep=4 must divide the data ranks dp x cp = 6"):
        check_expert_parallel(dataclasses.replace(moe, n_experts=8), 4, 6)
    with pytest.raises(ValueError, match="top_k=5 exceeds n_experts=4"):
        check_expert_parallel(dataclasses.replace(moe, top_k=5), 2, 2)
    with pytest.raises(ValueError, match="n_experts=0"):
        check_expert_parallel(PRESETS["tiny"], 2, 2)
    check_expert_parallel(PRESETS["tiny"], 1, 3)  # ep=1 is always fine
    with pytest.raises(ValueError, match="dp=8 data ranks need 8 ranks"):
        ExpertRunConfig(ep=2, dp=8).validate(4)
    with pytest.raises(ValueError, match="ep=4 must divide the data ranks dp x cp = 2"):
        ExpertRunConfig(model=dataclasses.replace(moe, n_experts=8), ep=4, dp=2).validate(4)
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by dp=4"):
        ExpertRunConfig(ep=4, global_batch=6).validate(4)
    with pytest.raises(ValueError, match="dense"):
        ExpertRunConfig(model="tiny").validate(4)


def test_a_pipeline_stage_converted_in_place_matches_the_dense_stage(cluster4):
    from jobs_expert import stage_batch, stage_step

    from labkit.models import build_model
    from labkit.parallel.pipeline.stage import StageModule

    r = cluster4.run(stage_step, None)
    dense = StageModule(build_model(PRESETS["tiny-moe"], seed=0), 1, 2)
    set_token_groups(dense, 4)  # the four ranks' rows are the four token groups
    h, y = stage_batch(8)
    StageModule.loss(dense(h), y).backward()
    want = {dense.full_name(n): p.grad for n, p in dense.named_parameters()}
    params = {dense.full_name(n): p.detach() for n, p in dense.named_parameters()}
    assert "layers.1.mlp.experts.w1" in want and "norm.weight" in want
    for out in r.outputs:
        assert out["n_local"] == 1 and out["names"] == ["layers.0.mlp.experts.w1",
                                                        "layers.0.mlp.experts.w3",
                                                        "layers.0.mlp.experts.w2"]
        assert out["errors"] == ["apply_expert_parallel: the module is already expert-parallel"]
        _assert_close_state(out["grads"], want, "stage grad")
        _assert_close_state(out["params"], params, "stage param")
    with pytest.raises(ValueError, match="no MoE layer"):
        from labkit.parallel.expert import apply_expert_parallel
        apply_expert_parallel(build_model(PRESETS["tiny"]), None)
