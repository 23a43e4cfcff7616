"""The ``labkit`` command line: own cluster, bad input, and the same job under torchrun."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import cli

REPO = Path(__file__).resolve().parents[1]
RUN = ["run", "--dp", "2", "--steps", "3", "--model", "tiny"]
ROW = re.compile(r"^│\s*(\d+)\s*│\s*[\d.]+\s*│", re.M)  # a rank row: rank, step ms, ...


def _labkit(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _torchrun(*args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _labkit("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(port), "-m", "labkit", *args)


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def cluster_json():
    return json.loads(_ok(_labkit("-m", "labkit", *RUN, "--json")))


@pytest.mark.distributed
def test_run_prints_table_with_every_rank(tmp_path):
    trace = tmp_path / "cli_trace.json"
    out = _ok(_labkit("-m", "labkit", *RUN, "--trace", str(trace)))
    assert "model tiny" in out and "world 2" in out and "backend gloo" in out
    assert ROW.findall(out) == ["0", "1"]
    assert "2(N-1)/N" in out and "MFU" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert any(e["name"] == "all_reduce" for e in events)


@pytest.mark.parametrize("args,words", [
    (["--dp", "3"], ["global_batch=8", "dp=3"]),
    (["--dp", "2", "--model", "nope"], ["unknown model preset 'nope'", "tiny"]),
    (["--dp", "2", "--micro-batch", "3"], ["global_batch=8", "2 x 3 = 6"]),
    (["--dp", "2", "--model", "llama3-8b"], ["planning"]),
    (["--dp", "2", "--zero", "5"], ["zero_stage", "got 5"]),
    (["--dp", "4", "--zero", "3", "--hsdp-replicas", "3"], ["hsdp_replicas=3", "dp=4"]),
    (["--dp", "2", "--zero", "0", "--hsdp-replicas", "2"], ["hsdp_replicas=2", "zero_stage 1-3"]),
    (["--dp", "2", "--lr", "-1"], ["lr must be", "-1.0"]),
    (["--pp", "2", "--lr", "0"], ["lr must be", "0.0"]),
    (["--dp", "2", "--trace", "/nonexistent-labkit-dir/run.json"],
     ["--trace", "/nonexistent-labkit-dir does not exist"]),
    (["--dp", "2", "--trace", "/tmp"], ["--trace /tmp: that is a folder"]),
    (["--dp", "2", "--bucket-mb", "nan"], ["bucket_mb must be a finite number > 0, got nan"]),
    (["--dp", "2", "--global-batch", "-8"], ["global_batch must be a positive int, got -8"]),
    (["--dp", "2", "--no-prefetch"], ["--no-prefetch", "plain DP gathers no parameters"]),
    (["--dp", "2", "--zero", "1", "--no-prefetch"], ["--zero 1 gathers no parameters"]),
    (["--pp", "64"], ["pp=64 would start 64 rank processes", "CPU cores"]),
    (["--pp", "2", "--n-layers", "100000"], ["100000 layers", "GB before activations",
                                              "this machine has available"]),
    (["--dp", "2", "--trace", ""], ["--trace needs a file name"]),
])
def test_bad_input_exits_2_fast_without_traceback(args, words):
    t0 = time.perf_counter()
    proc = _labkit("-m", "labkit", "run", "--steps", "3", *args, timeout=30)
    assert time.perf_counter() - t0 < 3.0
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for w in words:
        assert w in err


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if anything starts a Cluster; not under torchrun."""
    import labkit.cluster

    def boom(*a, **k):
        raise AssertionError("a Cluster was started for invalid input")

    monkeypatch.setattr(labkit.cluster, "Cluster", boom)
    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_bad_input_starts_no_process(no_cluster, capsys):
    assert cli.main(["run", "--dp", "3", "--model", "tiny"]) == 2
    assert "global_batch=8" in capsys.readouterr().err


def test_zero_bad_input_starts_no_process(no_cluster, capsys):
    for argv, words in ((["--zero", "4"], ["got 4"]),
                        (["--zero", "2", "--hsdp-replicas", "4"], ["hsdp_replicas=4", "dp=2"]),
                        (["--zero", "3", "--dp-mode", "naive"], ["--dp-mode naive"])):
        assert cli.main(["run", "--dp", "2", "--model", "tiny", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        assert all(w in err for w in words), err


ZROW = re.compile(r"^│\s*(\d+)\s*│(.*)$", re.M)
PAIR = re.compile(r"([\d,.]+) / ([\d,.]+)")


@pytest.mark.distributed
def test_run_zero3_prints_memory_and_bytes_per_collective():
    """``labkit run --zero 3``: memory by category and bytes per collective, measured
    beside predicted; the per-collective counts equal the prediction exactly."""
    out = _ok(_labkit("-m", "labkit", "run", "--dp", "2", "--zero", "3", "--steps", "3",
                      "--model", "tiny"))
    assert "ZeRO-3 · K=2 shards × M=1 replicas" in out and "prefetch on" in out
    assert "memory per rank" in out and "bytes per collective" in out
    head, comm = out.split("bytes per collective")
    mem_rows, comm_rows = ZROW.findall(head), ZROW.findall(comm)
    assert [r for r, _ in mem_rows] == ["0", "1"] and [r for r, _ in comm_rows] == ["0", "1"]
    for _, cells in mem_rows:  # params / grads / optim: measured == labkit.plan (MiB, 3 d.p.)
        pairs = PAIR.findall(cells)
        assert len(pairs) >= 3 and all(a == b for a, b in pairs[:3]), cells
    for _, cells in comm_rows:  # reduce-scatter and all-gather: counted == predicted
        rs, ag = PAIR.findall(cells)[:2]
        assert rs[0] == rs[1] != "0" and ag[0] == ag[1] != "0", cells
    assert "keep_last" in out and "global loss" in out


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
    monkeypatch.setattr(cli, "_BENCH_MODULE", "labkit.collectives._not_in_this_build")
    assert cli.main(["bench", "collectives", "--rounds", "1"]) == 2
    assert "not available in this build" in capsys.readouterr().err
    monkeypatch.undo()
    bench = cli._load_bench_collectives()
    if bench is None:
        pytest.skip("labkit.collectives.bench is not in this build")
    with pytest.raises(SystemExit) as info:  # its own options, through our subcommand
        cli.main(["bench", "collectives", "--help"])
    assert info.value.code == 0 and "labkit bench collectives" in capsys.readouterr().out


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
def test_bench_bad_input_exits_2_before_any_rank(args, words):
    """These used to loop forever (factor 1, min size 0), trace back from the ranks, or
    fail after the whole sweep (output paths)."""
    t0 = time.perf_counter()
    proc = _labkit("-m", "labkit", "bench", "collectives", "--world-size", "2", "--max-size",
                   "1KiB", *args, timeout=30)
    assert time.perf_counter() - t0 < 10.0
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "Traceback" not in err
    assert all(w in err for w in words), err


def test_torchrun_detection():
    assert cli.under_torchrun({"TORCHELASTIC_RUN_ID": "x"})
    assert cli.under_torchrun({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert not cli.under_torchrun({"LOCAL_RANK": "0"}) and not cli.under_torchrun({})


@pytest.mark.distributed
def test_torchrun_prints_table_once_and_matches_cluster(cluster_json):
    out = _ok(_torchrun(*RUN))
    assert out.count("labkit run · model tiny") == 1 and "launcher torchrun" in out
    assert ROW.findall(out) == ["0", "1"]
    theirs = json.loads(_ok(_torchrun(*RUN, "--json")))
    assert theirs["launcher"] == "torchrun" and theirs["world_size"] == 2
    ours = cluster_json
    assert ours["launcher"] == "cluster"
    for a, b in zip(ours["ranks"], theirs["ranks"]):
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-6)
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)
    assert [r["metrics"]["comm_bytes_per_step"] for r in theirs["ranks"]] == \
        [r["metrics"]["comm_bytes_predicted"] for r in theirs["ranks"]]


# --------------------------------------------------------------------------- --pp
BUBBLE = re.compile(r"bubble \(idle / total\): measured ([\d.]+) % · simulated ([\d.]+) %")


def _pipeline_table(out: str) -> None:
    """The --pp table: a row per rank, bubble measured beside simulated, memory and MFU."""
    assert ROW.findall(out) == ["0", "1"], out
    meas, sim = map(float, BUBBLE.search(out).groups())
    assert 0 < meas < 100 and 0 < sim < 100
    assert "1f1b        P=2 M=4 V=1: bubble measured" in out and "simulated" in out
    assert "activ. MiB" in out and "in-flight µb" in out and "MFU %" in out
    rows = dict(ZROW.findall(out))
    for r, first_inflight in (("0", "2"), ("1", "1")):  # 1F1B: rank r holds P − r
        assert f"{first_inflight} / {first_inflight}" in rows[r], rows[r]


@pytest.mark.distributed
def test_run_pp_prints_measured_and_simulated_bubble():
    out = _ok(_labkit("-m", "labkit", "run", "--pp", "2", "--microbatches", "4", "--schedule",
                      "1f1b", "--steps", "2"))
    assert "labkit run · pipeline · model tiny · 2 layers" in out and "world 2" in out
    assert "schedule 1f1b · P=2 M=4 V=1" in out and "launcher cluster" in out
    _pipeline_table(out)


@pytest.mark.distributed
def test_run_pp_under_torchrun():
    out = _ok(_torchrun("run", "--pp", "2", "--microbatches", "4", "--steps", "2"))
    assert out.count("labkit run · pipeline") == 1 and "launcher torchrun" in out
    _pipeline_table(out)


@pytest.mark.parametrize("args,words", [
    (["--pp", "2", "--microbatches", "3"], ["global_batch=8", "microbatches=3"]),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "3", "--n-layers", "8"],
     ["virtual_stages=3", "4 layers per rank"]),
    (["--pp", "4", "--n-layers", "2"], ["4 stages", "n_layers=2", "more stages than layers"]),
    (["--pp", "2", "--schedule", "dualpipe"], ["unknown schedule 'dualpipe'", "zb-v"]),
    (["--pp", "2", "--dp", "2"], ["N-D composition is not available yet", "--dp 2"]),
    (["--pp", "2", "--zero", "3"], ["N-D composition is not available yet", "--zero 3"]),
    (["--microbatches", "4"], ["--microbatches", "--pp"]),
    (["--pp", "2", "--micro-batch", "2"], ["--micro-batch 2"]),
    (["--pp", "2", "--bucket-mb", "-3"], ["--bucket-mb -3", "a --pp run has none"]),
    (["--pp", "2", "--no-prefetch"], ["--no-prefetch", "a --pp run has none"]),
    (["--pp", "2", "--n-layers", "0"], ["n_layers must be a positive int, got 0"]),
    (["--pp", "2", "--seed", "-5"], ["seed must be an int >= 0, got -5"]),
])
def test_pp_bad_input_exits_2_fast(args, words):
    t0 = time.perf_counter()
    proc = _labkit("-m", "labkit", "run", "--steps", "2", *args, timeout=30)
    assert time.perf_counter() - t0 < 3.0
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert all(w in err for w in words), err


def test_pp_bad_input_starts_no_process(no_cluster, capsys):
    assert cli.main(["run", "--pp", "2", "--microbatches", "3"]) == 2
    assert "microbatches=3" in capsys.readouterr().err


def test_pp_deepens_a_shallow_model_and_counts_every_flop():
    """tiny (2 layers) at pp=4 gets one layer per stage; the ranks' FLOPs add up to the
    whole model's for one microbatch (so MFU over the pipeline is the usual MFU)."""
    from labkit.measure.flops import count_flops
    from labkit.models import build_model
    from labkit.models.data import text_batch
    from labkit.parallel.pipeline.lab import lab_config, stage_flops

    assert lab_config("tiny", pp=2).n_layers is None  # 2 layers already fit
    for sched, pp, layers in (("1f1b", 4, 4), ("interleaved", 2, 4), ("zb-v", 2, 4)):
        cfg = lab_config("tiny", pp=pp, microbatches=4, schedule=sched).validate()
        assert cfg.model_config.n_layers == layers
        mc = cfg.model_config
        model = build_model(mc, seed=0)
        x, y = text_batch(0, cfg.micro, mc.seq_len, 0)
        whole = count_flops(lambda m=model, x=x, y=y: m(x, y).backward()).total
        assert sum(stage_flops(cfg, r) for r in range(pp)) == whole
