"""The ``labkit`` command line: one RunConfig from flags, its own cluster, bad input before
any process, and the same job under torchrun.

One run goes through the real entry point (``python -m labkit run``: its own Cluster
started and closed, exit 0); the other compositions call :func:`labkit.cli.main` in this
process with the session's warm cluster lent to the ``with Cluster(world_size=...)`` in
:func:`labkit.cli.launch.cmd_run` (:func:`_run_here`, tests/lending.py), so each pays for
its job, not for a Python start and ``world_size`` torch imports."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from lending import lend

from labkit import cli
from labkit.cli import run as cli_run
from labkit.config import ParallelConfig, RunConfig

REPO = Path(__file__).resolve().parents[1]
RUN = ["run", "--dp", "2", "--steps", "3", "--model", "tiny"]
ROW = re.compile(r"^│\s*(\d+)\s*│(.*)$", re.M)  # a table row: first cell a rank number
PAIR = re.compile(r"([\d,.]+) / ([\d,.]+)")
BUBBLE = re.compile(r"bubble \(idle / total\): measured ([\d.]+) % · simulated ([\d.]+) %")


def _labkit(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _torchrun(*args, nproc=2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _labkit("-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "labkit",
                   *args)


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _tables(out: str) -> tuple:
    """``(memory rows, comm rows)``: ``{rank: cells}`` of the memory table and of the
    bytes table (the pipeline table, if any, comes after the second)."""
    head, rest = out.split("bytes each rank sends per step")
    comm = rest.split("pipeline · schedule")[0]
    return dict(ROW.findall(head)), dict(ROW.findall(comm))


def _header_cells(out: str, title: str) -> list:
    """Column headers (first header line) of the table printed after ``title``."""
    block = out.split(title, 1)[1]
    first = next(line for line in block.splitlines() if line.startswith("┃"))
    return [c.strip() for c in first.strip("┃").split("┃")]


def _model_state_equal(mem_rows: dict) -> None:
    """params / grads: measured == labkit.plan on every rank (MiB, 3 decimals); optimizer
    state within 0.001 MiB (AdamW's 4-byte step count per parameter tensor is not in the
    prediction and can tip the third decimal)."""
    for r, cells in mem_rows.items():
        pairs = PAIR.findall(cells)
        assert len(pairs) >= 3 and all(a == b for a, b in pairs[:2]), (r, cells)
        assert 0 <= float(pairs[2][0]) - float(pairs[2][1]) <= 0.001 + 1e-9, (r, cells)


def _run_here(cluster, *argv) -> str:
    """``labkit run *argv`` in this process on the warm session ``cluster``: exit 0, and the
    CLI asked for exactly ``Cluster(world_size=cluster.world_size)``; returns what it
    printed."""
    out, err = io.StringIO(), io.StringIO()
    with lend(cluster) as asked, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        rc = cli.main(["run", *argv])
    assert rc == 0, f"exit {rc}\n{out.getvalue()}\n{err.getvalue()}"
    assert asked == [((), {"world_size": cluster.world_size})], asked
    return out.getvalue()


@pytest.fixture(scope="module")
def cluster_json(cluster2):
    return json.loads(_run_here(cluster2, *RUN[1:], "--json"))


# --------------------------------------------------------------------------- flags → config
def _parse(*argv) -> RunConfig:
    return cli_run.config_from_args(cli.build_parser().parse_args(["run", *argv]))


def _changed(cfg: RunConfig) -> set:
    """Fields of ``cfg`` that differ from the defaults (``parallel.dp`` for a degree;
    ``dataset`` follows ``model``)."""
    base = RunConfig()
    out = {f.name for f in dataclasses.fields(RunConfig) if f.name not in ("parallel", "dataset")
           and getattr(cfg, f.name) != getattr(base, f.name)}
    return out | {f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)
                  if getattr(cfg.parallel, f.name) != getattr(base.parallel, f.name)}


def _example(flag) -> tuple:
    """(argv, the value the field must take) for one flag."""
    if flag.type is None:
        return [flag.flag], flag.const
    value = {int: "5", float: "0.25", str: "an-example"}[flag.type]
    if flag.flag == "--model":
        return [flag.flag, "small"], "small"
    if flag.flag == "--n-layers":
        return [flag.flag, value], None
    return [flag.flag, value], flag.type(value)


def test_every_runconfig_field_is_set_by_exactly_its_flag():
    """Walk RunConfig's fields: each is reachable from a flag (or a listed exception with a
    reason), and each flag changes its field and no other."""
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"parallel"}
    fields |= {f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)}
    flagged = {f.field for f in cli_run.FLAGS}
    assert set(cli_run.NOT_FLAGS) <= fields and not set(cli_run.NOT_FLAGS) & flagged
    assert all(len(why) > 20 for why in cli_run.NOT_FLAGS.values())
    assert flagged | set(cli_run.NOT_FLAGS) == fields, \
        sorted(fields - flagged - set(cli_run.NOT_FLAGS))
    for flag in cli_run.FLAGS:
        argv, want = _example(flag)
        cfg = _parse(*argv)
        assert _changed(cfg) == {flag.field}, (flag.flag, _changed(cfg))
        if flag.flag == "--n-layers":
            assert cfg.model_config.n_layers == 5 and cfg.model_config.name == "tiny"
        else:
            obj, name = (cfg.parallel, flag.field[9:]) if flag.field.startswith("parallel.") \
                else (cfg, flag.field)
            assert getattr(obj, name) == want, flag.flag
    assert _changed(_parse()) == set()  # no flag: every default
    assert _parse("--model", "vit-digits").dataset == "digits"


def test_one_command_takes_every_degree_and_knob():
    cfg = _parse("--dp", "4", "--zero", "3", "--hsdp-replicas", "2", "--no-prefetch",
                 "--no-keep-last", "--pp", "2", "--schedule", "interleaved", "--microbatches",
                 "4", "--virtual-stages", "2", "--n-layers", "8", "--checkpoint", "every",
                 "--checkpoint-every", "1", "--global-batch", "16")
    assert (cfg.parallel.dp, cfg.parallel.pp, cfg.zero_stage, cfg.hsdp_replicas) == (4, 2, 3, 2)
    assert (cfg.prefetch, cfg.keep_last, cfg.schedule, cfg.microbatches) == \
        (False, False, "interleaved", 4)
    assert (cfg.virtual_stages, cfg.checkpoint, cfg.checkpoint_every) == (2, "every", 1)
    # segments of 2 blocks under ZeRO-3 over 4 data ranks are refused (validate's rank limits)
    assert _parse("--checkpoint", "every", "--checkpoint-every", "2").checkpoint_every == 2
    assert cfg.validate(8).mesh.shape == (2, 2, 2, 1, 1)  # pp, dp_replicate, dp_shard, cp, tp
    # bf16 with ZeRO-3 over pp and a tied embedding is refused, so it is checked on its own
    bf16 = _parse("--dp", "2", "--zero", "2", "--precision", "bf16", "--adam-eps", "1e-6")
    assert (bf16.precision, bf16.adam_eps, bf16.zero_stage) == ("bf16", 1e-6, 2)


def test_resolve_deepens_a_shallow_model_unless_n_layers_fixes_it():
    parser = cli.build_parser()
    r = cli_run.resolve(parser.parse_args(["run", "--pp", "4"]))
    assert r.cfg.model_config.n_layers == 4 and r.world_size == 4
    assert r.notes == {"deepened": {"from": 2, "to": 4}}
    r = cli_run.resolve(parser.parse_args(["run", "--pp", "2", "--schedule", "interleaved"]))
    assert r.cfg.model_config.n_layers == 4 and r.cfg.n_stages == 4
    assert cli_run.resolve(parser.parse_args(["run", "--pp", "2"])).notes == {}
    with pytest.raises(cli.UsageError, match="4 stages but the model has n_layers=2"):
        cli_run.resolve(parser.parse_args(["run", "--pp", "4", "--n-layers", "2"]))


def test_torchrun_degrees_fill_dp_and_must_multiply_to_world_size():
    parser = cli.build_parser()

    def resolve(*argv, world):
        return cli_run.resolve(parser.parse_args(["run", *argv]), torchrun_world=world,
                               check_machine=False)

    assert resolve(world=2).cfg.parallel.dp == 2
    assert resolve("--pp", "2", world=4).cfg.parallel.dp == 2
    assert resolve("--pp", "2", world=2).cfg.parallel.dp == 1
    for argv, words in ((["--dp", "3"], "3 x 1 x 1 x 1 = 3 must equal torchrun's WORLD_SIZE=2"),
                        (["--pp", "3"], "1 x 1 x 3 x 1 = 3 must equal torchrun's WORLD_SIZE=2"),
                        (["--dp", "1", "--pp", "1"], "= 1 must equal torchrun's WORLD_SIZE=2"),
                        (["--timeout", "60"], "timeout_s=60 is the own cluster's guard")):
        with pytest.raises(cli.UsageError) as info:
            resolve(*argv, world=2)
        assert words in str(info.value)


def test_node_flags_are_checked_before_launch():
    """--nodes/--inter-node/--latency-ms: refused with the flag and the numbers."""
    parser = cli.build_parser()

    def resolve(*argv, world=None):
        return cli_run.resolve(parser.parse_args(["run", *argv]), torchrun_world=world,
                               check_machine=False)

    assert resolve("--dp", "4", "--nodes", "2", "--inter-node", "1gbit").world_size == 4
    for argv, world, words in (
            (["--dp", "2", "--nodes", "3"], None, "--nodes 3 must divide the world size "
                                                  "dp·tp·pp·cp = 2"),
            (["--dp", "2", "--inter-node", "1gbit"], None, "give --nodes 2 or more"),
            (["--dp", "2", "--nodes", "2", "--inter-node", "fast"], None,
             "inter_node='fast'"),
            (["--nodes", "2"], 2, "under torchrun the nodes are torchrun's")):
        with pytest.raises(cli.UsageError) as info:
            resolve(*argv, world=world)
        assert words in str(info.value)


@pytest.mark.distributed
def test_run_with_nodes_asks_for_an_emulated_cluster(cluster2):
    """`labkit run --nodes 2 --inter-node 200mbit` builds its Cluster with those nodes (the
    session pool is lent: what runs on the nodes is tests/test_nodes.py's)."""
    out, err = io.StringIO(), io.StringIO()
    with lend(cluster2) as asked, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        rc = cli.main(["run", "--dp", "2", "--steps", "1", "--nodes", "2",
                       "--inter-node", "200mbit"])
    assert rc == 0, err.getvalue()
    assert asked == [((), {"world_size": 2, "nodes": 2, "inter_node": "200mbit",
                           "latency_ms": None})]


def test_check_run_fits_counts_model_state_per_rank_on_the_mesh(monkeypatch):
    """Per rank: the larger of the whole fp32 model (4Ψ) and the state once placed on the
    mesh — Ψ/pp parameters each, ZeRO sharding over dp_shard (not the HSDP replicas)."""
    from labkit import preflight
    from labkit.models.gpt import count_params

    seen = []
    monkeypatch.setattr(preflight, "check_model_state_fits",
                        lambda total, what, fraction=0.9: seen.append(total))
    base = RunConfig(model="gpt2-124m")
    psi = count_params(base.model_config)
    for kw, ranks, per_param in ((dict(dp=2), 2, 16), (dict(pp=2), 2, 8),
                                 (dict(dp=4, zero_stage=3), 4, 4),
                                 (dict(dp=4, zero_stage=3, hsdp_replicas=2), 4, 8),
                                 (dict(dp=2, pp=2, zero_stage=1), 4, 6),
                                 (dict(dp=4, zero_stage=3, precision="bf16"), 4, 4)):
        preflight.check_run_fits(base.replace(**kw).validate())
        assert seen.pop() == pytest.approx(ranks * (per_param * psi + preflight.PROCESS_BYTES)), kw


def test_ag_hidden_is_a_dash_when_nothing_is_gathered():
    from labkit.cli.report import ag_hidden

    overlap = {"forward": 0.4, "backward": 0.7, "total": 0.54}
    hsdp = {"comm_bytes_by_axis": {"dp": {"all_gather": 0.0, "all_reduce": 492800.0}},
            "overlap": overlap}
    fsdp = {"comm_bytes_by_axis": {"dp": {"all_gather": 459904.0}}, "overlap": overlap}
    assert ag_hidden(hsdp) is None and ag_hidden(fsdp) == 0.54
    assert ag_hidden({"comm_bytes_by_axis": {"dp": {"all_reduce": 1.0}}}) is None
    # sequence parallelism's all-gathers (axis tp) beside a one-shard ZeRO-3: still nothing
    # of ZeRO's is gathered, so nothing of it can be hidden
    sp = {"comm_bytes_by_axis": {"dp": {"all_gather": 0.0}, "tp": {"all_gather": 16384.0}},
          "overlap": overlap}
    assert ag_hidden(sp) is None


# --------------------------------------------------------------------------- bad input
@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if anything starts a Cluster; not under torchrun."""
    import labkit.cluster

    def boom(*a, **k):
        raise AssertionError("a Cluster was started for invalid input")

    monkeypatch.setattr(labkit.cluster, "Cluster", boom)
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


BAD = [
    (["--dp", "3"], ["global_batch=8", "dp=3"]),
    (["--dp", "2", "--model", "nope"], ["unknown model preset 'nope'", "tiny"]),
    (["--n-layers", "4", "--model", "nope"], ["unknown model preset 'nope'"]),
    (["--dp", "2", "--micro-batch", "3"], ["global_batch=8", "2 x 3 = 6"]),
    (["--dp", "2", "--model", "llama3-8b"], ["planning"]),
    (["--dp", "2", "--zero", "5"], ["zero_stage must be 0, 1, 2 or 3, got 5",
                                    "--zero sets zero_stage"]),
    (["--dp", "4", "--zero", "3", "--hsdp-replicas", "3"], ["hsdp_replicas=3", "dp=4"]),
    (["--dp", "2", "--zero", "2", "--hsdp-replicas", "4"], ["hsdp_replicas=4", "dp=2"]),
    (["--dp", "2", "--hsdp-replicas", "2"], ["hsdp_replicas=2", "zero_stage 1-3"]),
    (["--dp", "2", "--lr", "-1"], ["lr must be", "-1.0"]),
    (["--pp", "2", "--lr", "0"], ["lr must be", "0.0"]),
    (["--dp", "2", "--bucket-mb", "nan"], ["bucket_mb must be a finite number > 0, got nan"]),
    (["--dp", "2", "--global-batch", "-8"], ["global_batch must be an int >= 1, got -8"]),
    (["--dp", "2", "--no-prefetch"], ["prefetch=False has no effect", "zero_stage=0",
                                      "--no-prefetch sets prefetch"]),
    (["--dp", "2", "--zero", "1", "--no-keep-last"], ["keep_last=False", "zero_stage=1",
                                                      "--no-keep-last sets keep_last"]),
    (["--dp", "2", "--zero", "3", "--dp-mode", "naive"], ["dp_mode='naive'", "zero_stage=3"]),
    (["--dp", "2", "--dp-mode", "torch"], ["dp_mode must be one of", "impl='torch'"]),
    (["--dp", "2", "--zero", "3", "--find-unused"], ["find_unused=True", "zero_stage=3"]),
    (["--tp", "3"], ["n_heads=4 does not divide by tp=3"]),
    (["--sp"], ["sequence_parallel=True", "tp > 1", "--sp sets sequence_parallel"]),
    (["--dp", "2", "--cp", "3"], ["sequence length 64 does not divide by 2·cp = 6"]),
    (["--no-zigzag"], ["cp_zigzag=False", "cp=1", "--no-zigzag sets cp_zigzag"]),
    (["--cp-method", "ulysses"], ["cp_method='ulysses'", "cp=1"]),
    (["--dp", "2", "--ep", "2"], ["ep=2 needs a mixture-of-experts model", "n_experts=0"]),
    (["--ep", "2", "--model", "tiny-moe"], ["ep=2 must divide the data ranks dp x cp = 1 x 1 = 1"]),
    (["--checkpoint", "sometimes"], ["checkpoint must be one of", "'sometimes'"]),
    (["--checkpoint-every", "2"], ["checkpoint_every=2", "checkpoint='every' (got 'none')"]),
    (["--precision", "fp16"], ["precision must be one of", "'fp16'"]),
    (["--impl", "torch", "--dp", "2", "--pp", "2"], ["impl='torch'", "ONE parallelism"]),
    (["--dp", "2", "--zero", "3", "--compile"], ["compile=True with zero_stage=3"]),
    (["--timeout", "0"], ["timeout_s must be a finite number > 0, got 0.0",
                          "--timeout sets timeout_s"]),
    (["--pp", "2", "--microbatches", "3"], ["microbatches=3", "8"]),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3", "--n-layers", "5"],
     ["pp x virtual_stages = 2 x 3 = 6 stages but the model has n_layers=5"]),
    (["--pp", "2", "--schedule", "zb-v", "--virtual-stages", "3"],
     ["schedule 'zb-v' runs 2 stage(s) per rank, got virtual_stages=3"]),
    (["--pp", "4", "--n-layers", "2"], ["4 stages", "n_layers=2", "more stages than layers"]),
    (["--pp", "2", "--schedule", "dualpipe"], ["unknown schedule 'dualpipe'", "zb-v"]),
    (["--pp", "2", "--dp", "2", "--zero", "3", "--schedule", "zb-v"],
     ["schedule='zb-v' with zero_stage=3"]),
    (["--microbatches", "4"], ["microbatches=4 has no effect", "pp=1"]),
    (["--schedule", "gpipe"], ["schedule='gpipe' has no effect", "pp=1"]),
    (["--pp", "2", "--n-layers", "0"], ["n_layers must be >= 1, got 0"]),
    (["--pp", "2", "--seed", "-5"], ["seed must be an int >= 0, got -5"]),
    (["--pp", "0"], ["ParallelConfig.pp must be a positive int, got 0"]),
    (["--pp", "64"], ["pp=64 would start 64 rank processes", "CPU cores"]),
    (["--dp", "2", "--pp", "64", "--global-batch", "128"],
     ["dp x pp = 2 x 64 = 128 would start 128 rank processes"]),
    (["--pp", "2", "--n-layers", "100000"], ["100000 layers", "GB before activations",
                                              "this machine has available"]),
    (["--dp", "2", "--trace", "/nonexistent-labkit-dir/run.json"],
     ["--trace", "/nonexistent-labkit-dir does not exist"]),
    (["--dp", "2", "--trace", "/tmp"], ["--trace /tmp: that is a folder"]),
    (["--dp", "2", "--trace", ""], ["--trace needs a file name"]),
    # the same rule as --trace: only the last part of the path is created
    (["--dp", "2", "--save-dir", "/nonexistent-labkit-dir/x"],
     ["save_dir=/nonexistent-labkit-dir/x", "/nonexistent-labkit-dir does not exist"]),
    (["--dp", "2", "--save-dir", "/etc/hostname"], ["save_dir", "that is a file"]),
]


@pytest.mark.parametrize("args,words", BAD)
def test_bad_input_names_the_field_and_starts_no_process(no_cluster, capsys, args, words):
    assert cli.main(["run", "--steps", "3", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("args,words", [
    (["--dp", "3"], ["global_batch=8", "dp=3"]),
    (["--dp", "2", "--zero", "5"], ["--zero sets zero_stage"]),
    (["--dp", "x"], ["argument --dp: invalid int value: 'x'"]),
    (["--pp", "2", "--schedule", "dualpipe"], ["unknown schedule 'dualpipe'"]),
])
def test_bad_input_exits_2_before_torch_loads(args, words):
    """As a fresh process: one ``error:`` line, exit 2, and torch never imported (only
    torch-free modules load before the input is validated)."""
    code = ("import sys; from labkit.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    proc = _labkit("-c", code, "run", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() in ("False", "")  # argparse errors exit inside parse_args
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert all(w in err for w in words), err


def test_module_entry_point_reports_bad_input():
    proc = _labkit("-m", "labkit", "run", "--dp", "2", "--tp", "3", timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: n_heads=4 does not divide "
                                                           "by tp=3"), proc.stderr


# --------------------------------------------------------------------------- own cluster
@pytest.mark.distributed
def test_run_prints_mesh_memory_bytes_and_writes_trace(tmp_path):
    trace = tmp_path / "cli_trace.json"
    out = _ok(_labkit("-m", "labkit", *RUN, "--trace", str(trace)))
    assert "labkit run · model tiny · 2 layers" in out and "world 2" in out
    assert "backend gloo" in out and "launcher cluster" in out
    assert "Mesh dp_replicate=2 (2 ranks)" in out and "dp_replicate groups: (0,1)" in out
    mem, comm = _tables(out)
    assert sorted(mem) == sorted(comm) == ["0", "1"]
    _model_state_equal(mem)
    assert _header_cells(out, "bytes each rank sends")[1:4] == ["dp all_reduce", "total",
                                                                 "dp formula"]
    for cells in comm.values():  # all-reduce 2(N-1)/N·|θ|·4 = |θ|·4 at N = 2
        assert PAIR.findall(cells)[0] == ("492,800", "492,800"), cells
        assert cells.split("│")[2].strip() == "492,800"
    assert "MFU %" in out and "HFU %" in out and "loss (global batch)" in out
    assert "pipeline · schedule" not in out and "AG hidden" not in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert any(e["name"] == "all_reduce" for e in events)
    assert f"trace → {trace}" in out


@pytest.mark.distributed
def test_run_json_is_plain_data(cluster_json):
    out = cluster_json
    assert out["launcher"] == "cluster" and out["world_size"] == 2
    assert out["config"] == dataclasses.asdict(RunConfig(steps=3).replace(dp=2))
    assert out["mesh"].startswith("Mesh dp_replicate=2") and len(out["losses"]) == 3
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["losses"] == out["losses"]  # the global loss, on every rank
        m = r["metrics"]
        assert m["comm_bytes_by_axis"] == {"dp": {"all_reduce": 492800.0}}
        assert m["comm_predicted_by_axis"] == m["comm_bytes_by_axis"]
        assert m["memory"]["model_state"]["parameters"] == m["memory_predicted"]["parameters"]
    assert "pipeline" not in out


@pytest.mark.distributed
def test_run_zero3_memory_and_bytes_per_collective(cluster2):
    """``--zero 3``: model state and reduce-scatter / all-gather bytes equal their
    predictions on every rank; the all-gather time hidden is a percentage."""
    out = _run_here(cluster2, "--dp", "2", "--zero", "3", "--steps", "3")
    assert "ZeRO-3 · K=2 shards × M=1 replicas · prefetch on · keep_last on" in out
    mem, comm = _tables(out)
    _model_state_equal(mem)
    cols = _header_cells(out, "bytes each rank sends")
    assert cols[1:3] == ["dp reduce_scatter", "dp all_gather"] and cols[-1] == "AG hidden"
    for cells in comm.values():
        rs, ag = PAIR.findall(cells)[:2]
        assert rs[0] == rs[1] != "0" and ag[0] == ag[1] != "0", cells
        assert re.fullmatch(r"\d+\.\d", cells.strip().strip("│").split("│")[-1].strip())
    assert "keep_last (the root unit's backward all-gather is not repeated)" in out
    assert "warm-up" not in out  # 3 steps: a steady step was timed


@pytest.mark.distributed
def test_run_hsdp_one_shard_per_group_prints_dash_for_ag_hidden(cluster2):
    """HSDP with M=2 replicas of K=1 shard: nothing is all-gathered, so the hidden
    fraction is '—' (not a percentage of empty calls)."""
    out = _run_here(cluster2, "--dp", "2", "--zero", "3", "--hsdp-replicas", "2", "--steps",
                    "2")
    assert "ZeRO-3 · K=1 shards × M=2 replicas" in out
    mem, comm = _tables(out)
    _model_state_equal(mem)
    cols = _header_cells(out, "bytes each rank sends")
    assert cols[1:4] == ["dp all_reduce", "dp reduce_scatter", "dp all_gather"]
    for cells in comm.values():
        ar, rs, ag = PAIR.findall(cells)[:3]
        assert ar == ("492,800", "492,800") and rs == ag == ("0", "0"), cells
        assert cells.strip().strip("│").split("│")[-1].strip() == "—", cells


def _bubble_section(out: str, pp_rows: dict) -> None:
    """The bubble: measured beside simulated, the ladder, and 1F1B's in-flight counts."""
    meas, sim = map(float, BUBBLE.search(out).groups())
    assert 0 < meas < 100 and 0 < sim < 100
    assert "bubble, rung by rung: unit costs" in out and "MFU ceiling" in out
    assert "note: " in out
    block = out.split("per pipeline rank:")[1]
    rows = dict(ROW.findall(block))
    assert sorted(rows) == sorted(pp_rows)
    for r, inflight in pp_rows.items():
        assert f"{inflight} / {inflight}" in rows[r], rows[r]


@pytest.mark.distributed
def test_run_pp_prints_measured_and_simulated_bubble(cluster2):
    out = _run_here(cluster2, "--pp", "2", "--microbatches", "4", "--schedule", "1f1b",
                    "--steps", "2")
    assert "labkit run · model tiny · 2 layers ·" in out and "world 2" in out
    assert "pipeline · schedule 1f1b · P=2 M=4 V=1 · " in out and "launcher cluster" in out
    assert "1f1b        P=2 M=4 V=1: bubble measured" in out
    # 2 steps: the second measures memory, so only the warm-up step was timed, and it says so
    assert "warning: only the first (warm-up) step was timed" in out
    mem, comm = _tables(out)
    assert sorted(mem) == ["0", "1"]
    _model_state_equal(mem)
    for cells in comm.values():  # 4 boundary activations (2, 64, 64) fp32 each way
        assert PAIR.findall(cells)[0] == ("196,608", "196,608"), cells
    _bubble_section(out, {"0": 2, "1": 1})  # 1F1B: pipeline rank r holds P − r


@pytest.mark.distributed
def test_run_pp_json_has_the_pipeline_summary_and_rows(cluster4):
    out = json.loads(_run_here(cluster4, "--pp", "4", "--microbatches", "4", "--steps", "2",
                               "--json"))
    assert out["deepened"] == {"from": 2, "to": 4}  # tiny: one layer per stage
    assert out["config"]["model"]["n_layers"] == 4 and out["config"]["parallel"]["pp"] == 4
    s, rows = out["pipeline"]["summary"], out["pipeline"]["rows"]
    assert (s["schedule"], s["pp"], s["microbatches"]) == ("1f1b", 4, 4)
    assert 0 < s["bubble"] < 1 and 0 < s["bubble_simulated"] < 1
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert [r["peak_inflight"] for r in rows] == [4, 3, 2, 1] == \
        [r["predicted_inflight"] for r in rows]  # 1F1B: P - r
    assert all(r["losses"] == out["losses"] for r in out["ranks"])


# --------------------------------------------------------------------------- N-D, 4 ranks
@pytest.mark.distributed
def test_run_dp2_pp2_on_four_ranks(cluster4):
    """``--dp 2 --pp 2``, interleaved: tiny (2 layers) deepened to pp x V = 4, two
    pipelines, the bubble read from the first, all-reduce and boundary bytes as predicted."""
    out = _run_here(cluster4, "--dp", "2", "--pp", "2", "--schedule", "interleaved", "--steps",
                    "2")
    assert ("4 layers (preset 'tiny' has 2; deepened to pp x V = 4, one layer per stage)"
            in out and "world 4" in out)
    assert "Mesh pp=2 x dp_replicate=2 (4 ranks)" in out
    assert "the first of 2 pipelines" in out
    mem, comm = _tables(out)
    assert sorted(mem) == ["0", "1", "2", "3"]
    _model_state_equal(mem)
    assert _header_cells(out, "bytes each rank sends")[1:4] == ["dp all_reduce", "pp send",
                                                                 "total"]
    for cells in comm.values():
        ar, send = PAIR.findall(cells)[:2]
        assert ar[0] == ar[1] != "0" and send[0] == send[1] != "0", cells
    _bubble_section(out, {"0": 5, "1": 3})  # interleaved P=2 M=4 V=2: stage-microbatches


@pytest.mark.distributed
def test_run_zero3_dp2_pp2_on_four_ranks(cluster4):
    out = _run_here(cluster4, "--zero", "3", "--pp", "2", "--dp", "2", "--microbatches", "4",
                    "--steps", "2")
    assert "ZeRO-3 · K=2 shards × M=1 replicas" in out and "world 4" in out
    assert "Mesh pp=2 x dp_shard=2 (4 ranks)" in out
    mem, comm = _tables(out)
    assert sorted(mem) == ["0", "1", "2", "3"]
    # the tied embedding stays out of ZeRO's flat units (replicated on the first and last
    # stage's ranks): the prediction must count it unsharded
    _model_state_equal(mem)
    cols = _header_cells(out, "bytes each rank sends")
    assert {"dp reduce_scatter", "dp all_gather", "dp all_reduce", "pp send"} <= set(cols)
    for cells in comm.values():
        for a, b in PAIR.findall(cells):
            assert a == b, cells  # every collective and the sends: counted == predicted
        assert re.fullmatch(r"\d+\.\d", cells.strip().strip("│").split("│")[-1].strip())
    _bubble_section(out, {"0": 2, "1": 1})


# --------------------------------------------------------------------------- torchrun
def test_torchrun_detection():
    assert cli.under_torchrun({"TORCHELASTIC_RUN_ID": "x"})
    assert cli.under_torchrun({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert not cli.under_torchrun({"LOCAL_RANK": "0"}) and not cli.under_torchrun({})


def test_torchrun_bad_degrees_exit_2_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["run", "--dp", "3"]) == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["run", "--dp", "3"]) == 2
    assert "must equal torchrun's WORLD_SIZE=2" in capsys.readouterr().err


@pytest.mark.distributed
def test_torchrun_prints_the_report_once_and_matches_cluster(cluster_json):
    """Rank 0 alone prints (one JSON document: a second would make ``json.loads`` fail),
    with every rank's output gathered; the same losses and bytes as on a cluster. The text
    report under torchrun: :func:`test_run_pp_under_torchrun`."""
    out = _ok(_torchrun(*RUN, "--json"))
    assert out.count('"launcher"') == 1
    theirs = json.loads(out)
    assert theirs["launcher"] == "torchrun" and theirs["world_size"] == 2
    assert [r["rank"] for r in theirs["ranks"]] == [0, 1]
    ours = cluster_json
    assert theirs["config"] == ours["config"]
    for a, b in zip(ours["ranks"], theirs["ranks"]):
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
        assert a["metrics"]["comm_bytes_by_axis"] == b["metrics"]["comm_bytes_by_axis"]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)


@pytest.mark.distributed
def test_run_pp_under_torchrun():
    out = _ok(_torchrun("run", "--pp", "2", "--microbatches", "4", "--steps", "2"))
    assert out.count("labkit run · model tiny") == 1 and "launcher torchrun" in out
    assert out.count("pipeline · schedule 1f1b · P=2 M=4 V=1") == 1
    mem, comm = _tables(out)
    assert sorted(mem) == sorted(comm) == ["0", "1"]  # every rank's row, gathered to rank 0
    _model_state_equal(mem)
    _bubble_section(out, {"0": 2, "1": 1})


def test_script_under_torchrun_skips_interpreter_teardown(monkeypatch, capsys):
    """As a script under torchrun, main() ends the rank with os._exit(rc) after flushing;
    called with argv (as here and from Python code) it returns normally."""
    exits = []

    def fake_exit(rc):
        exits.append(rc)
        raise SystemExit(rc)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(cli.sys, "argv", ["labkit", "plan", "memory", "--params", "1e9"])
    with pytest.raises(SystemExit):
        cli.main()
    assert exits == [0] and "16,000,000,000" in capsys.readouterr().out
    assert cli.main(["plan", "memory", "--params", "1e9"]) == 0 and exits == [0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cli.sys, "argv", ["labkit", "run", "--dp", "3"])
    with pytest.raises(SystemExit):
        cli.main()
    assert exits == [0, 2]


# --------------------------------------------------------------------------- plan, bench
def test_plan_memory(capsys):
    assert cli.main(["plan", "memory", "--params", "7.5e9", "--ranks", "64", "--zero", "3",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes"]["total"] == pytest.approx(1.875e9)  # ZeRO-3: 16 B/param / 64
    assert cli.main(["plan", "memory", "--params", "7.5B"]) == 0
    assert "120,000,000,000" in capsys.readouterr().out  # plain DP: 120 GB (claim C11)
    assert cli.main(["plan", "memory", "--params", "1e9", "--ranks", "0"]) == 2
    assert "n_ranks" in capsys.readouterr().err


def test_bench_collectives_is_lazy(monkeypatch, capsys):
    from labkit.cli import bench

    monkeypatch.setattr(bench, "BENCH_MODULE", "labkit.collectives._not_in_this_build")
    assert cli.main(["bench", "collectives", "--rounds", "1"]) == 2
    assert "not available in this build" in capsys.readouterr().err
    monkeypatch.undo()
    if bench.load() is None:
        pytest.skip("labkit.collectives.bench is not in this build")
    with pytest.raises(SystemExit) as info:  # its own options, through our subcommand
        cli.main(["bench", "collectives", "--help"])
    assert info.value.code == 0 and "labkit bench collectives" in capsys.readouterr().out


@pytest.mark.parametrize("args,words", [
    (["--factor", "1"], ["--factor must be >= 2, got 1"]),
    (["--min-size", "0"], ["need 1 <= --min-size <= --max-size, got 0"]),
    (["--rounds", "0"], ["--rounds and --iters must be >= 1, got --rounds 0, --iters auto"]),
    (["--iters", "-1"], ["--iters -1"]),
    (["--world-size", "1"], ["--world-size must be >= 2"]),
    (["--world-size", "999"], ["999 rank processes", "CPU cores"]),
    (["--html", "/nonexistent-labkit-dir/x.html"], ["--html", "does not exist"]),
    (["--json", "/tmp"], ["--json /tmp: that is a folder"]),
])
def test_bench_bad_input_exits_2_before_any_rank(no_cluster, capsys, args, words):
    """These used to loop forever (factor 1, min size 0), trace back from the ranks, or
    fail after the whole sweep (output paths)."""
    assert cli.main(["bench", "collectives", "--world-size", "2", "--max-size", "1KiB",
                     *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err
    assert all(w in err for w in words), err


@pytest.mark.distributed
def test_torchrun_two_emulated_nodes_match_the_cluster(cluster_json):
    """torchrun --nnodes 2, one launcher per emulated node (labkit.nodes.launch: each in
    its node's network namespace, rendezvous at node 0's address): the same losses and
    bytes as the one-node cluster, and the gradients' all-reduce really crossed the link
    (each node's tc counter carries at least the bytes labkit.comm says a rank sent)."""
    from labkit import nodes

    reason = nodes.probe()
    if reason:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{reason} (CI is set, so this is an error, not a skip)")
        pytest.skip(reason)
    env_path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path
    try:
        res, link = nodes.launch(2, 1, ["-m", "labkit", *RUN, "--json"], timeout_s=300)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    for r in res:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert res[1].stdout == ""  # rank 0 (node 0) alone prints
    theirs = json.loads(res[0].stdout)
    assert theirs["launcher"] == "torchrun" and theirs["world_size"] == 2
    ours = cluster_json
    assert theirs["config"] == ours["config"]
    for a, b in zip(ours["ranks"], theirs["ranks"]):
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
        assert a["metrics"]["comm_bytes_by_axis"] == b["metrics"]["comm_bytes_by_axis"]
    sent = sum(theirs["ranks"][0]["metrics"]["comm_bytes_by_axis"]["dp"].values())
    steps = theirs["config"]["steps"]
    assert all(b >= sent * steps for b in link.values()), (link, sent, steps)
