"""The data-parallel wrappers used directly, under adversarial inputs, checked on every rank
against exact values: one collective order whatever order autograd runs in; every gradient
accumulation pattern; ``reduce_op``; ``ignored_params`` with a second wrapper on another
group; mixed precision against a bf16-aware reference and FSDP2."""
from __future__ import annotations

import itertools

import pytest
import torch
from jobs_dp import PATTERNS, collective_sequence, dense_experts_reference, mlp_reference

from labkit.parallel.dp.ordered import CollectiveProgram, OrderError, backward_program

pytestmark = pytest.mark.distributed

TOL = 1e-6


def _cluster(request, n: int):
    """The warm ``n``-rank cluster (only the one a test needs is started)."""
    return request.getfixturevalue(f"cluster{n}"), n


def _wrapper_bytes(trace, rank: int, op: str, step: int) -> float:
    """Bytes of the wrapper's own collectives (not the gathers tests make to read state)."""
    return sum(e.bytes_sent for e in trace.events
               if e.rank == rank and e.op == op and e.step == step
               and e.args.get("mesh_dim") == "shard")


def _one_sequence(r, ranks) -> list:
    """Every rank issued the same collectives (op, bucket/unit, size) in the same order."""
    seqs = [collective_sequence(r.trace, k) for k in ranks]
    for k, s in zip(ranks, seqs):
        assert s == seqs[0], (k, s, seqs[0])
    return seqs[0]


# ================================================================ 1. one order on every rank
@pytest.mark.parametrize("mode,reduce_op,a,b", [
    ("ddp", "avg", 1.5, 15.0), ("naive", "avg", 1.5, 15.0), ("torch", "avg", 1.5, 15.0),
    ("ddp", "sum", 3.0, 30.0), ("naive", "sum", 3.0, 30.0)])
def test_ddp_buckets_go_out_in_one_order(cluster2, mode, reduce_op, a, b):
    """The two-parameter model, 2 MiB each, one bucket each: rank 0's backward produces
    ``b`` first, rank 1's ``a`` first. Mean gradients a = 1.5, b = 15 on both ranks (sum:
    3, 30), two steps in a row."""
    r = cluster2.run("jobs_dp:ddp_order", dict(mode=mode, reduce_op=reduce_op), timeout_s=120)
    orders = [o["steps"][0]["order"] for o in r.outputs]
    assert orders[0] == ["b", "a"] and orders[1] == ["a", "b"]  # the orders really differ
    for o in r.outputs:
        for st in o["steps"]:
            assert st["a"] == (a, a) and st["b"] == (b, b), st
    if mode == "ddp":
        assert _one_sequence(r, [0, 1]) == [("all_reduce", 0, 2**19), ("all_reduce", 1, 2**19)] * 2


@pytest.mark.parametrize("stage,split,keep_last,prefetch", [
    (1, True, True, True), (2, True, True, True), (3, True, True, True),
    (3, False, True, True), (3, False, False, True), (3, False, True, False),
    (3, True, False, False)])
@pytest.mark.parametrize("reduce_op", ["avg", "sum"])
def test_sharded_units_go_out_in_one_order(cluster2, stage, split, keep_last, prefetch,
                                           reduce_op):
    """Two units A, B (weights 1 and 2) and a root scale; rank 0 runs A first, rank 1 B
    first, in forward and (split) in separate backward passes. Losses 1344 and 2688
    (mixed-up gathers change them); gradients scale 252, A 1.5, B 15 (sum: ×2)."""
    cfg = dict(stage=stage, split=split, keep_last=keep_last, prefetch=prefetch,
               reduce_op=reduce_op)
    r = cluster2.run("jobs_dp:sharded_order", cfg, timeout_s=120)
    orders = [o["steps"][0]["order"] for o in r.outputs]
    assert orders[0] != orders[1], orders  # the gradients really complete in other orders
    f = 2.0 if reduce_op == "sum" else 1.0
    for rank, o in enumerate(r.outputs):
        for st in o["steps"]:
            assert st["loss"] == 1344.0 * (rank + 1)
            assert st["grads"] == {"scale": (252 * f,) * 2, "layers.0.weight": (1.5 * f,) * 2,
                                   "layers.1.weight": (15 * f,) * 2}, st
    _one_sequence(r, [0, 1])


def test_backward_program_is_one_sequence_for_any_two_unit_order():
    """Pure: two ranks, every order of needing and finishing two units, with and without
    prefetch: the issued sequences are identical; a backward three units out of order
    raises OrderError instead of mixing units."""
    ops = backward_program(["root", "L1", "L0"], ["L1", "L0", "root"])
    assert ops == [("ag", "root"), ("ag", "L1"), ("ag", "L0"), ("rs", "L1"), ("rs", "L0"),
                   ("rs", "root")]

    def run(order, prefetch):
        seq: list = []
        prog = CollectiveProgram(ops, seq.append, pull=[o for o in ops if o[0] == "ag"])
        prog.pull(("ag", "root"))
        for u in order:
            prog.pull(("ag", u))
            if prefetch:
                nxt = [o for o in ops if o[0] == "ag" and not prog.issued(o)]
                if nxt:
                    prog.pull(nxt[0], force=False)
            prog.mark_ready(("rs", u))
        prog.mark_ready(("rs", "root"))
        prog.flush()
        return seq

    seqs = [run(order, pf) for order in itertools.permutations(["L1", "L0"])
            for pf in (False, True)]
    assert all(s == ops for s in seqs)
    three = backward_program(["root", "L2", "L1", "L0"], ["L2", "L1", "L0", "root"])
    prog = CollectiveProgram(three, list().append, pull=[o for o in three if o[0] == "ag"],
                             describe=lambda op: f"{op[0]} {op[1]}")
    prog.pull(("ag", "L1"))
    with pytest.raises(OrderError, match="needs ag L0 before rs L2 is ready"):
        prog.pull(("ag", "L0"))
    buckets: list = []  # DDP: push only — ready in any order, issued in index order
    prog = CollectiveProgram(range(4), buckets.append)
    for i in (2, 3, 0, 1):
        prog.mark_ready(i)
    assert buckets == [0, 1, 2, 3]


# ================================================================ 2. every accumulation pattern
# sends of the whole gradient per step, by wrapper and pattern (a "send" is one all-reduce
# per bucket, or one reduce-scatter per unit): DDP, ZeRO-1 and ZeRO-3 (``no_sync`` keeps its
# full gradients) send once per synced microbatch and again at the end if gradients changed
# after the last send; ZeRO-2 sends in every backward, no_sync or not ("direct" writes no
# gradient through autograd: one send, at the end).
SENDS = {
    "naive": dict(last=1, every=1, mixed=1, synced_then_not=1, none=1, direct=1),
    "ddp": dict(last=1, every=3, mixed=2, synced_then_not=3, none=1, direct=1),
    "zero2": dict(last=3, every=3, mixed=3, synced_then_not=3, none=3, direct=1),
}
SENDS["zero1"] = SENDS["zero3"] = SENDS["ddp"]
SENDS["hsdp2"], SENDS["hsdp3"] = SENDS["zero2"], SENDS["zero3"]
CASES = ([(w, p) for w in SENDS for p in PATTERNS]  # partial: values and order only
         + [("torch", p) for p in ("last", "every", "mixed")])


@pytest.mark.parametrize("wrapper,pattern", CASES, ids=lambda x: x)
def test_every_accumulation_pattern_equals_one_process(request, wrapper, pattern):
    """Three microbatches of a 3-layer MLP, synced per ``pattern``: the gradient on every
    rank is the single-process mean over ranks of the summed microbatch gradients (1e-6),
    the traffic is exactly the sends the pattern calls for, and a second
    ``finish_gradient_sync`` on the same gradients is refused."""
    hsdp = wrapper.startswith("hsdp")
    cluster, n = _cluster(request, 4 if hsdp else 2)
    r = cluster.run("jobs_dp:accumulate", dict(wrapper=wrapper, pattern=pattern),
                    timeout_s=120)
    ref = mlp_reference(n, pattern=pattern)
    for o in r.outputs:
        grads = o["grads"] if wrapper != "torch" else o
        assert set(grads) == set(ref)
        for name, g in ref.items():
            assert (grads[name] - g).abs().max().item() < TOL, (name, grads[name], g)
        if wrapper != "torch":
            assert "again" in o["repeated"]
    if wrapper == "torch":
        return
    seq = _one_sequence(r, range(n))
    if pattern not in SENDS[wrapper]:
        return
    op = "all_reduce" if wrapper in ("naive", "ddp") else "reduce_scatter"
    sends = [s for s in seq if s[0] == op]
    per_send = {"naive": 7, "ddp": None}.get(wrapper, 4)  # params / buckets / units
    if per_send is None:
        per_send = len({s[1] for s in sends})
    assert len(sends) == SENDS[wrapper][pattern] * per_send, sends
    n_params = sum(g.numel() for g in ref.values())  # 158
    k = 2
    for rank in range(n):
        sent = r.trace.comm_bytes(rank, op=op)
        if op == "all_reduce":
            assert sent == SENDS[wrapper][pattern] * 2 * (n - 1) / n * n_params * 4
        else:  # units padded to a multiple of K = 2: 4 + 56 + 72 + 28 = 160 elements
            assert sent == SENDS[wrapper][pattern] * (k - 1) / k * 160 * 4
    if hsdp:  # then one all-reduce of the 80-element gradient shards over the 2 replicas
        assert r.trace.comm_bytes(0, op="all_reduce") == 2 * (1 / 2) * 80 * 4


@pytest.mark.parametrize("wrapper", ["naive", "ddp", "zero1", "zero2", "zero3", "hsdp2",
                                     "hsdp3"])
def test_sum_is_avg_times_group_size_exactly(request, wrapper):
    """``reduce_op="sum"``: the plain sum over ranks = the mean × N, bit for bit."""
    cluster, n = _cluster(request, 4 if wrapper.startswith("hsdp") else 2)
    avg, tot = (cluster.run("jobs_dp:accumulate", dict(wrapper=wrapper, pattern="mixed",
                                                       reduce_op=op)).outputs
                for op in ("avg", "sum"))
    ref = mlp_reference(n, reduce_op="sum")
    for a, s in zip(avg, tot):
        for name in a["grads"]:
            assert torch.equal(s["grads"][name], a["grads"][name] * n)
            assert (s["grads"][name] - ref[name]).abs().max().item() < 4 * TOL


# ================================================================ 3. ignored parameters
@pytest.mark.parametrize("dense", ["ddp", "zero2", "zero3"])
def test_two_wrappers_over_disjoint_parameters_on_two_groups(cluster4, dense):
    """Dense parameters reduced over all 4 ranks, expert parameters by a second
    DataParallel over the pairs {0, 2} and {1, 3}. The first wrapper leaves the experts
    alone: no hook, no broadcast (their rank-dependent start survives it), no unit, local
    gradients until the second wrapper syncs them over the pair."""
    r = cluster4.run("jobs_dp:two_wrappers", dict(dense=dense), timeout_s=120)
    ref = dense_experts_reference(4)
    expert_names = ["layers.0.expert.weight", "layers.0.expert.bias"]
    for rank, o in enumerate(r.outputs):
        assert o["hooks_on_experts_before_second"] == 0
        assert torch.equal(o["expert_weight_after_wrap"], torch.full((4, 4), rank % 2 + 1.0))
        pair = (rank % 2, rank % 2 + 2)
        for i, name in enumerate(expert_names):
            assert (o["expert_local"][i] - ref[rank][name]).abs().max().item() < TOL
            mean = (ref[pair[0]][name] + ref[pair[1]][name]) / 2
            assert (o["expert_synced"][i] - mean).abs().max().item() < TOL
        assert set(o["dense"]) == set(ref[0]) - set(expert_names)
        for name, g in o["dense"].items():
            mean = sum(ref[k][name] for k in range(4)) / 4
            assert (g - mean).abs().max().item() < TOL, name


# ================================================================ 4. mixed precision (bf16)
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradient_is_mean_not_sum(cluster2, stage):
    """bf16 weights, inputs and reduce-scatter, chosen so every value is exact in bf16:
    the mean gradient over the two rows is exactly w = [13.625, −6.875, 8.0625], b = 0.5
    (a sum would be twice that)."""
    for o in cluster2.run("jobs_dp:bf16_mean", dict(stage=stage)).outputs:
        assert o["weight"].tolist() == [[13.625, -6.875, 8.0625]]
        assert o["bias"].tolist() == [0.5]


_GPT: dict = {}


def _gpt(cluster, **cfg):
    key = tuple(sorted(cfg.items()))
    if key not in _GPT:
        _GPT[key] = cluster.run("jobs_dp:gpt_sharded", cfg, timeout_s=180)
    return _GPT[key]


# bf16 keeps 8 significant bits: one rounding is off by at most 2^-8 (its unit roundoff)
# relative to the value. labkit's bf16 reduce-scatter rounds the ranks' sum once, so its mean
# gradient is exactly bf16(g0 + g1) / 2 of the per-rank bf16 gradients, and within 2^-8,
# element by element, of their exact mean.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_zero_matches_bf16_reference_and_fsdp2(cluster2, stage):
    """labkit's bf16 ZeRO-2/3 (bf16 parameters, gradients and reduce-scatter, fp32 master)
    against (a) a single-process bf16-aware reference (the same bf16 model per rank batch,
    run on one rank so the numerics are the ranks'): the gradient is exactly the bf16-rounded
    sum halved, and within the unit roundoff of the exact mean; (b) FSDP2 ``fully_shard``
    with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` on the same GPT and
    batches: losses, gradients of both steps and parameters after two AdamW steps equal bit
    for bit; (c) the wrapper's bf16 traffic is exactly half the fp32 run's."""
    ours = _gpt(cluster2, impl="labkit", stage=stage, bf16=True)
    fsdp2 = _gpt(cluster2, impl="fsdp2", stage=3, bf16=True)
    ref = cluster2.run("jobs_dp:gpt_bf16_reference", 2, nranks=1).outputs[0]
    for rank, (o, t) in enumerate(zip(ours.outputs, fsdp2.outputs)):
        assert o["steps"][0]["loss"] == ref[rank]["loss"]
        grads = o["steps"][0]["grads"]
        assert len(grads) == len(ref[0]["grads"]) == 20
        for name, mine in grads.items():
            g0, g1 = ref[0]["grads"][name], ref[1]["grads"][name]
            assert torch.equal(mine, (g0 + g1).bfloat16().float() / 2), name
            exact = (g0 + g1) / 2
            assert ((mine - exact).abs() <= BF16_UNIT_ROUNDOFF * exact.abs()).all(), name
        for s in range(2):
            assert o["steps"][s]["loss"] == t["steps"][s]["loss"]
            for name, mine in o["steps"][s]["grads"].items():
                assert torch.equal(mine, t["steps"][s]["grads"][name]), (s, name)
        for name, p in o["params"].items():
            assert torch.equal(p, t["params"][name]), name
    fp32 = _gpt(cluster2, impl="labkit", stage=stage, bf16=False)
    for rank in range(2):
        for op in ("reduce_scatter", "all_gather"):
            half = _wrapper_bytes(fp32.trace, rank, op, 1) / 2
            assert _wrapper_bytes(ours.trace, rank, op, 1) == half > 0


# ================================================================ recomputation
@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpointed_blocks_recompute_inside_the_wrapper(cluster2, stage, policy):
    """Activation checkpointing recomputes a block's forward inside backward; ZeRO-3 must
    neither gather it out of order nor free it then. Loss and gradients equal the run
    without recomputation (1e-6) on every rank."""
    plain = cluster2.run("jobs_dp:gpt_checkpointed", dict(stage=stage, policy="none")).outputs
    ckpt = cluster2.run("jobs_dp:gpt_checkpointed", dict(stage=stage, policy=policy)).outputs
    for p, c in zip(plain, ckpt):
        assert c["loss"] == pytest.approx(p["loss"], abs=TOL)
        for name, g in p["grads"].items():
            assert (c["grads"][name] - g).abs().max().item() < TOL, name


@pytest.mark.parametrize("wrapper", ["ddp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("pattern", ["last", "every"])
def test_recomputed_module_calls_inside_the_wrapper(cluster2, wrapper, pattern):
    """``checkpoint(layer, x)`` re-runs each unit's module call, hooks and all, in backward:
    the MLP's gradients still equal one process's (1e-6) on every rank."""
    r = cluster2.run("jobs_dp:accumulate", dict(wrapper=wrapper, pattern=pattern, recompute=True))
    ref = mlp_reference(2, pattern=pattern)
    for o in r.outputs:
        for name, g in ref.items():
            assert (o["grads"][name] - g).abs().max().item() < TOL, name
    _one_sequence(r, [0, 1])


def test_zero3_refuses_multi_block_checkpoint_segments(cluster2):
    """A 2-block checkpoint segment runs block 1 inside block 0's forward, unseen by its
    hooks: ZeRO-3 says so on every rank, before any gather, instead of computing with
    ungathered parameters (read with ``error_of``: no pool restart)."""
    errors = cluster2.run("jobs_for_tests:error_of", (
        "jobs_dp:gpt_checkpointed", dict(stage=3, policy="every", every=2))).outputs
    assert len(errors) == 2 and all(e is not None and e["type"] == "ValueError" and
                                    "2-block checkpoint segment" in e["message"]
                                    for e in errors), errors


@pytest.mark.parametrize("mode", ["ddp", "naive"])
@pytest.mark.parametrize("pattern", ["none", "every", "mixed"])
def test_unused_parameter_raises_under_every_pattern(cluster2, mode, pattern):
    """A parameter no microbatch used is named (not hung, not silently zero) whether the
    microbatches were synced or not, on every rank (read with ``error_of``: no pool
    restart); with find_unused it keeps grad None on every rank (no rank used it, as torch
    DDP) and the rest get the mean."""
    errors = cluster2.run("jobs_for_tests:error_of", (
        "jobs_dp:unused_pattern", dict(mode=mode, find_unused=False, pattern=pattern)),
        timeout_s=60).outputs
    assert len(errors) == 2 and all(e is not None and e["type"] == "RuntimeError"
                                    and "head_b" in e["message"] for e in errors), errors
    out = cluster2.run("jobs_dp:unused_pattern", dict(mode=mode, find_unused=True,
                                                      pattern=pattern), timeout_s=60).outputs
    for o in out:
        assert o["head_b.weight"] is None and o["head_b.bias"] is None
        for name in ("body.weight", "body.bias", "head_a.weight", "head_a.bias"):
            assert torch.equal(o[name], out[0][name]) and o[name].abs().sum() > 0


def test_unused_parameters_match_torch_ddp_and_one_process(cluster2):
    """``never`` (no rank uses it) and ``rank0`` (rank 0 only) under
    ``DataParallel(find_unused=True)``, both modes, on every rank equal torch's
    ``DistributedDataParallel(find_unused_parameters=True)`` and one process over both ranks'
    inputs: ``never`` keeps grad None, so AdamW's weight decay leaves it alone; ``rank0``
    gets the mean with rank 1 contributing zeros. ZeRO's flat units give every parameter a
    gradient, so there ``never`` gets zeros and decays by exactly ``lr·wd`` — the documented
    difference (RunConfig.find_unused, ShardedDataParallel); everything else matches."""
    from jobs_dp import UNUSED_LR, UNUSED_WD

    outs = cluster2.run("jobs_dp:unused_vs_torch", {}, timeout_s=60).outputs
    init = outs[0]["one"]["params"]  # never moves in one process: its initial value
    for rank, out in enumerate(outs):
        one = out["one"]
        assert one["grads"]["never.weight"] is None and one["grads"]["rank0.weight"] is not None
        for kind in ("ddp", "naive", "torch"):
            got = out[kind]
            for name, ref in one["grads"].items():
                g = got["grads"][name]
                assert (g is None) == (ref is None), (rank, kind, name, g)
                if ref is not None:
                    torch.testing.assert_close(g, ref, rtol=0, atol=1e-6,
                                               msg=f"rank {rank} {kind} grad {name}")
            for name, ref in one["params"].items():
                torch.testing.assert_close(got["params"][name], ref, rtol=0, atol=1e-6,
                                           msg=f"rank {rank} {kind} param {name}")
        for kind in ("zero1", "zero2", "zero3"):
            got = out[kind]
            for name, ref in one["grads"].items():
                want = torch.zeros_like(init[name]) if ref is None else ref
                torch.testing.assert_close(got["grads"][name], want, rtol=0, atol=1e-6,
                                           msg=f"rank {rank} {kind} grad {name}")
            for name, ref in one["params"].items():
                if name.startswith("never."):  # zero gradient: only the decay moves it
                    ref = init[name] * (1 - UNUSED_LR * UNUSED_WD)
                    assert not torch.equal(ref, init[name])
                torch.testing.assert_close(got["params"][name], ref, rtol=0, atol=1e-6,
                                           msg=f"rank {rank} {kind} param {name}")
