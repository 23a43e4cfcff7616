"""labkit.collectives: hand-built ring / tree / pairwise algorithms against torch.distributed.

* pure: formulas, busbw factors, validation messages, record replay (no processes);
* parity: for every world size 2…8, every hand-built algorithm against native on the same
  seeded inputs — sum/max/min/avg, int64 (exact) and float32 (1e-6) — with the bytes
  labkit.comm counted equal to the formulas exactly (claims C4, C6);
* the issue's three "inputs that must come out right" cases, and the RS+AG identity (C5);
* the busbw benchmark on tiny sizes, through ``labkit bench collectives`` too.

One 8-rank cluster serves every world size (``nranks=N`` runs on ranks 0…N−1).
"""
from __future__ import annotations

import pytest
import torch

import labkit
from labkit.collectives import (bench, busbw_factor, check_divisible, formula_bytes, jobs,
                                tree_children)
from labkit.collectives.jobs import CollectiveConfig, ParityConfig
from labkit.collectives.record import Move, Recording

KiB = 1024


# cluster8 (conftest.py): one warm 8-rank pool; smaller world sizes run on its first N ranks


# --------------------------------------------------------------------------- pure
def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert busbw_factor(op, 4) == pytest.approx(0.75)
    assert busbw_factor("broadcast", 8) == busbw_factor("reduce", 8) == 1.0


@pytest.mark.parametrize("n", range(2, 9))
def test_formula_bytes_per_rank(n):
    s = 8 * n * 64
    assert formula_bytes("all_reduce", n, s, "ring") == (2 * (n - 1) * s / n,) * 2
    for op, algo in (("reduce_scatter", "ring"), ("all_gather", "ring"),
                     ("all_to_all", "pairwise")):
        assert formula_bytes(op, n, s, algo, rank=1) == ((n - 1) * s / n,) * 2
    for op in ("broadcast", "reduce"):  # S per hop: N−1 hops in all, each rank one parent
        per = [formula_bytes(op, n, s, "tree", r, root=1) for r in range(n)]
        assert sum(p[0] for p in per) == sum(p[1] for p in per) == (n - 1) * s
        one_way = [p[1] if op == "broadcast" else p[0] for p in per]
        assert sorted(one_way) == [0.0] + [float(s)] * (n - 1)
    rd = [formula_bytes("all_reduce", n, s, "recursive_doubling", r) for r in range(n)]
    if n & (n - 1) == 0:
        assert all(x == (n.bit_length() - 1) * s for pair in rd for x in pair)
    assert sum(tree_children(v, n) for v in range(n)) == n - 1


def test_uneven_sizes_are_refused_with_how_to_pad():
    with pytest.raises(ValueError, match=r"pad the flat input to 12 elements.*\(0, 2\)"):
        check_divisible(10, 4, "reduce_scatter")
    with pytest.raises(ValueError, match="pad"):
        CollectiveConfig("reduce_scatter", "ring", 4, inputs=([1] * 10,) * 4).validate(8)
    with pytest.raises(ValueError, match="pad"):
        CollectiveConfig("all_to_all", "pairwise", 4, inputs=([[1]] * 6,) * 4).validate(8)
    with pytest.raises(ValueError, match="floating-point"):
        CollectiveConfig("all_reduce", "ring", 4, reduce="avg", dtype="int64").validate(8)
    with pytest.raises(ValueError, match="choose one of native, ring"):
        CollectiveConfig("all_gather", "tree", 4).validate(8)
    with pytest.raises(ValueError, match="between 1 and"):
        CollectiveConfig(nranks=9).validate(8)


def test_recording_replays_contributors():
    # two ranks, ring reduce-scatter then all-gather, by hand
    snaps = [[[[1], [2]], [[10], [20]]], [[[1], [22]], [[11], [20]]],
             [[[11], [22]], [[11], [22]]]]
    moves = [Move(1, 1, 0, 1, 1, "reduce", "rs", 8), Move(1, 0, 1, 0, 0, "reduce", "rs", 8),
             Move(2, 1, 0, 0, 0, "copy", "ag", 8), Move(2, 0, 1, 1, 1, "copy", "ag", 8)]
    rec = Recording("all_reduce", "ring", 2, 2, snaps[0], snaps, ["", "rs", "ag"], moves)
    assert rec.contributors(0) == [[(0,), (0,)], [(1,), (1,)]]
    assert rec.contributors(1) == [[(0,), (0, 1)], [(0, 1), (1,)]]
    assert rec.contributors(2) == [[(0, 1)] * 2, [(0, 1)] * 2]
    assert rec.describe(2)[0] == "rank 1 → rank 0: chunk 0 copy"


def test_bench_helpers():
    assert bench.parse_size("1K") == KiB and bench.parse_size("64MiB") == 64 * 2 ** 20
    assert bench.default_sizes()[0] == KiB and bench.default_sizes()[-1] == 64 * 2 ** 20
    rows = [{"op": "all_reduce", "algorithm": a, "n": 2, "bytes": 16 * 2 ** 20, "busbw": b}
            for a, b in (("native", 2.0), ("ring", 1.8))]
    assert bench.ratios(rows)[0]["ratio"] == pytest.approx(0.9)


# --------------------------------------------------------------------------- parity
def _cases(n: int) -> tuple:
    cases = []
    for dtype in ("int64", "float32"):
        reds = ("sum", "max", "min") + (("avg",) if dtype == "float32" else ())
        for red in reds:
            cases += [("all_reduce", "ring", red, dtype, 3 * n),
                      ("all_reduce", "recursive_doubling", red, dtype, 5),
                      ("reduce_scatter", "ring", red, dtype, 2 * n),
                      ("reduce", "tree", red, dtype, 5)]
        cases += [("all_reduce", "ring", "sum", dtype, 3 * n + 1),  # padded internally
                  ("all_gather", "ring", "sum", dtype, 3),
                  ("all_to_all", "pairwise", "sum", dtype, 2 * n),
                  ("broadcast", "tree", "sum", dtype, 5)]
    return tuple(cases)


@pytest.mark.distributed
@pytest.mark.parametrize("n", range(2, 9))
def test_parity_and_bytes_against_native(cluster8, n):
    cfg = ParityConfig(n, _cases(n)).validate(cluster8.world_size)
    res = cluster8.run(jobs.parity, cfg, nranks=n)
    assert len(res.outputs) == n
    for i, case in enumerate(cfg.cases):
        op, algo, _red, dtype, _numel = case
        for rank, out in enumerate(res.outputs):
            got = out[i]
            assert got["case"] == case
            if op == "reduce" and rank != 0:  # only the root's buffer means anything
                assert got["native"] is None and got["hand"] is None
                continue
            hand, native = torch.tensor(got["hand"]), torch.tensor(got["native"])
            if dtype == "int64":
                assert torch.equal(hand, native), (case, rank)
            else:
                err = (hand - native).abs().max().item()
                assert torch.allclose(hand, native, rtol=1e-6, atol=1e-6), (case, rank, err)
            expected = formula_bytes(op, n, got["message_bytes"], algo, rank, 0)
            assert (got["bytes_sent"], got["bytes_recv"]) == expected, (case, rank)


# --------------------------------------------------------------------------- issue cases
@pytest.mark.distributed
@pytest.mark.parametrize("algo,list_form", [("native", False), ("native", True),
                                            ("pairwise", False)])
def test_all_to_all_world4_is_a_transpose(cluster8, algo, list_form):
    inputs = tuple([[10 * r + j] * 2 for j in range(4)] for r in range(4))
    run = jobs.run(cluster8, "all_to_all", algo, 4, inputs=inputs, list_form=list_form)
    for r in range(4):
        assert run.outputs[r] == [[10 * j + r] * 2 for j in range(4)]  # from rank j, in order
    assert run.bytes_match and run.bytes_sent == [3 / 4 * 64] * 4


@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["native", "tree"])
def test_reduce_world2_to_rank0(cluster8, algo):
    run = jobs.run(cluster8, "reduce", algo, 2, inputs=([[1, 2], [3, 4]], [[4, 5], [6, 7]]),
                   root=0)
    assert run.outputs[0] == [[5, 7], [9, 11]]
    assert run.outputs[1] is None  # rank 1's buffer is not meaningful afterwards
    assert run.bytes_match and run.bytes_sent == [0, 32] and run.bytes_recv == [32, 0]
    assert run.recording.snapshots[-1][1] == [None]  # not displayed as a result either


@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["native", "ring"])
def test_reduce_scatter_world4_rank_plus_one(cluster8, algo):
    inputs = tuple([[r + 1] * 3 for _ in range(4)] for r in range(4))  # four (3,) tensors
    run = jobs.run(cluster8, "reduce_scatter", algo, 4, inputs=inputs)
    assert run.outputs == [[10, 10, 10]] * 4
    assert run.bytes_match and run.bytes_sent == [3 / 4 * 96] * 4
    with pytest.raises(ValueError, match="pad the flat input to 12 elements"):
        jobs.run(cluster8, "reduce_scatter", algo, 4, inputs=tuple([r] * 10 for r in range(4)))


@pytest.mark.distributed
def test_all_reduce_is_reduce_scatter_then_all_gather(cluster8):
    """Claim C5: the same values and the same bytes."""
    n = 4
    ar = jobs.run(cluster8, "all_reduce", "ring", n)
    rs = jobs.run(cluster8, "reduce_scatter", "ring", n)
    ag = jobs.run(cluster8, "all_gather", "ring", n,
                  inputs=tuple(rs.outputs[r] for r in range(n)), m=1)
    assert [sum(ag.outputs[r], []) for r in range(n)] == [sum(a, []) for a in ar.outputs]
    assert [a + b for a, b in zip(rs.bytes_sent, ag.bytes_sent)] == ar.bytes_sent
    rec = ar.recording
    assert rec.steps == 2 * (n - 1) and all(len(rec.moves_at(s)) == n for s in range(1, 7))
    assert all(c == tuple(range(n)) for row in rec.contributors(rec.steps) for c in row)
    after_rs = rec.contributors(n - 1)
    assert all(after_rs[r][r] == tuple(range(n)) for r in range(n))
    for m in rec.moves:  # each move's values are the destination chunk after the step
        assert list(m.values) == rec.snapshots[m.step][m.dst][m.chunk]


@pytest.mark.distributed
def test_native_path_records_inputs_and_outputs(cluster8):
    run = jobs.run(cluster8, "all_gather", "native", 3)
    assert run.outputs[2] == [[0], [10], [20]]
    assert run.recording.steps == 1 and run.recording.moves == []


# --------------------------------------------------------------------------- benchmark
@pytest.mark.distributed
def test_busbw_rows_follow_the_definitions(cluster8):
    rows = bench.run_bench(cluster8, "all_reduce", (2, 4), (KiB, 4 * KiB), rounds=1, iters=2)
    assert {(r["n"], r["bytes"], r["algorithm"]) for r in rows} == {
        (n, b, a) for n in (2, 4) for b in (KiB, 4 * KiB) for a in ("native", "ring")}
    for r in rows:
        assert r["time_s"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (r["n"] - 1) / r["n"])
    assert bench.table(rows).row_count == 4
    fig = bench.figure(rows, reference={"memcpy": 5.0})
    assert len(fig.data) == 4 and fig.layout.xaxis.type == "log"
    more = bench.run_bench(cluster8, "broadcast", (3,), (KiB,), rounds=1, iters=1)
    assert {r["algorithm"] for r in more} == {"native", "tree"}


@pytest.mark.distributed
def test_cli_bench_collectives(cluster2, capsys):
    """The sweep on the session's 2 ranks, lent to the bench's own ``Cluster(2, ...)``."""
    from lending import lend

    from labkit import cli

    with lend(cluster2) as asked:
        assert cli.main(["bench", "collectives", "--world-size", "2", "--max-size", "4K",
                         "--rounds", "1", "--iters", "2", "--op", "all_gather"]) == 0
    assert asked == [((2,), {"backend": "gloo", "device": "cpu"})]
    out = capsys.readouterr().out
    assert "all_gather" in out and "busbw" in out and "4 KiB" in out
    assert cli.main(["bench", "collectives", "--op", "reduce", "--algorithm", "ring"]) == 2
    assert "no algorithm 'ring'" in capsys.readouterr().err
