"""What the training job reports as measured is measured: held against counts the test makes
itself (each traced collective's bytes recomputed from its element count and group size;
memory and traffic a user job adds by a known amount), where the prediction shown beside it
cannot produce the same number. Replacing a measurement by its prediction fails here."""
from __future__ import annotations

import pytest

from labkit.config import ModelConfig, RunConfig

pytestmark = pytest.mark.distributed

EXTRA_PARAM, EXTRA_REDUCE = 1000, 3000  # fp32 elements a user job adds (tests/jobs_measured.py)
RUN = RunConfig(steps=3, global_batch=8, count_flops=False, seed=11)
CASES = {"dp2": dict(dp=2), "zero3": dict(dp=2, zero_stage=3),
         # the used-map all-reduce (one fp32 per parameter) is traffic the prediction must hold
         "dp2-find-unused": dict(dp=2, find_unused=True),
         "zero2-bf16": dict(dp=2, zero_stage=2, precision="bf16"), "tp2": dict(tp=2),
         "tp2-sp": dict(tp=2, sequence_parallel=True),
         # 4 shards of flat units whose sizes are 2 mod 4: each unit padded by 2 elements
         "zero3-padded": dict(dp=4, zero_stage=3, model=ModelConfig(
             n_layers=2, d_model=18, n_heads=3, d_ff=45, vocab_size=256, seq_len=16))}
#: ring bytes per element for a group of n (labkit.comm's table, restated)
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
          "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}
_RUNS: dict = {}


def _run(cluster, name: str, **extra):
    key = (name, tuple(sorted(extra.items())))
    if key not in _RUNS:
        cfg = RUN.replace(**CASES[name])
        axis = "dp" if cfg.parallel.dp > 1 else "tp"
        _RUNS[key] = (cfg, axis, cluster.run("jobs_measured:train_with_extra",
                                             dict(cfg=cfg, axis=axis, **extra), timeout_s=300))
    return _RUNS[key]


def _elem(cfg, axis: str, op: str) -> int:
    """Element size the test expects: bf16 flat units reduce-scatter and gather bf16 over
    dp; everything else here (the user job's all-reduce included) is fp32."""
    return 2 if (cfg.precision == "bf16" and axis == "dp" and op != "all_reduce") else 4


def _cluster(request, name: str):
    return request.getfixturevalue("cluster4" if CASES[name].get("dp") == 4 else "cluster2")


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_are_the_traced_collectives(request, name):
    """Every rank's bytes per axis and collective are the sum over its traced events of the
    measured step, each event's bytes equal to its element count × element size × the ring
    factor of its group size (recomputed here, not by labkit.comm), and a user job's extra
    all-reduce of 3000 fp32 per step shows up exactly: measured − predicted = 2·(N−1)/N·12000
    bytes on that axis, nothing else changes."""
    cfg, axis, r = _run(_cluster(request, name), name, reduce=EXTRA_REDUCE)
    for rank, o in enumerate(r.outputs):
        m = o["metrics"]
        step = 1 if len(m["step_times"]) > 1 else 0
        traced: dict = {}
        for e in r.trace.events:
            if e.rank != rank or e.step != step or e.cat not in ("comm", "p2p"):
                continue
            ops = traced.setdefault(e.axis or "world", {})
            ops[e.op] = ops.get(e.op, 0.0) + e.bytes_sent
            if e.op in FACTOR and "numel" in e.args:
                want = FACTOR[e.op](len(e.peers)) * e.args["numel"] * _elem(cfg, e.axis, e.op)
                assert e.bytes_sent == want, (rank, e.op, e.axis, e.bytes_sent, want)
        assert m["comm_bytes_by_axis"] == traced, (rank, m["comm_bytes_by_axis"], traced)
        assert m["comm_bytes_per_step"] == sum(v for ops in traced.values() for v in ops.values())
        pred = m["comm_predicted_by_axis"]
        for ax, ops in pred.items():
            got = {k: v for k, v in traced[ax].items() if v}
            if ax == axis:
                n = cfg.parallel.dp if axis == "dp" else cfg.parallel.tp
                got["all_reduce"] -= 2 * (n - 1) / n * 4 * EXTRA_REDUCE
                got = {k: v for k, v in got.items() if v}
            assert got == ops, (rank, ax, got, ops)


@pytest.mark.parametrize("name", ["dp2", "zero3", "zero2-bf16", "tp2", "zero3-padded"])
def test_model_state_memory_is_what_the_rank_holds(request, name):
    """A user job puts 1000 fp32 elements more on the first stage (a parameter outside the
    optimizer, with a gradient of its size): every rank's measured parameter and gradient
    bytes are the prediction (which counts only what the job built) plus exactly 4000. With
    flat units padded to a multiple of the 4 shards, the padding is held and predicted."""
    cfg, _, r = _run(_cluster(request, name), name, param=EXTRA_PARAM)
    for rank, o in enumerate(r.outputs):
        m, extra = o["metrics"], o["extra"]
        got, pred = m["memory"]["model_state"], m["memory_predicted"]
        assert got["parameters"] - pred["parameters"] == extra["param_bytes"], (rank, got, pred)
        assert got["gradients"] - pred["gradients"] == extra["grad_bytes"], (rank, got, pred)
        if name == "zero3-padded":  # the case really pads: Σ padded > the real parameters
            assert pred["parameters"] // 4 * cfg.parallel.dp > m["rank_params"], (rank, pred)
