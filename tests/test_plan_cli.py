"""``labkit plan layout | search | validate | presets`` (``plan memory``: test_cli.py)."""
import json

import pytest

from labkit import cli

LAYOUT = ["plan", "layout", "--model", "llama3-405b", "--cluster", "llama3-24k", "--tp", "8",
          "--pp", "16", "--dp", "128", "--global-batch", "2048", "--schedule", "interleaved",
          "--virtual-stages", "4", "--checkpoint", "full"]


def test_plan_layout_json(capsys):
    assert cli.main(LAYOUT + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_gpus"] == 16384 and out["fits"] is True
    assert set(out["memory"]) >= {"parameters", "gradients", "optimizer", "activations",
                                  "comm_buffers", "total"}
    assert out["comm"]["tp"]["level"] == "nvlink" and out["comm"]["cp"]["bandwidth"] is None
    assert 0 < out["mfu"] < out["hfu"] < 1
    assert out["terms"]["bubble_ratio"]["value"] == pytest.approx(15 / (4 * 16))
    assert out["terms"]["mfu"]["source"]


def test_plan_layout_table(capsys):
    assert cli.main(LAYOUT + ["--terms"]) == 0
    out = capsys.readouterr().out
    for words in ("memory per GPU", "communication per GPU and step", "MFU", "nvlink",
                  "fits", "bubble_ratio", "Narayanan et al. 2021"):
        assert words in out, words


def _row(text: str, axis: str) -> list:
    """The cells of the communication table's row for ``axis`` (its first line)."""
    rows = [line for line in text.splitlines() if line.startswith(f"│ {axis} ")]
    assert len(rows) <= 1, rows
    return [c.strip() for c in rows[0].strip("│").split("│")] if rows else []


def test_plan_layout_table_times_the_expert_all_to_all(capsys):
    """A mixture-of-experts layout gets an ``ep`` row in the communication table: degree,
    level, bytes, time and exposed time of the expert all-to-all, the planner's own numbers
    (as --json gives them); a dense model's table has no such row."""
    # DeepSeek-V3's runtime hides most of it in the pipeline's steady state: time and
    # exposed time differ, so the two columns cannot be swapped unseen
    args = ["plan", "layout", "--model", "qwen1.5-moe-a2.7b", "--pp", "2", "--dp", "4",
            "--ep", "4", "--global-batch", "64", "--runtime", "deepseek-v3-2024"]
    assert cli.main(args + ["--json"]) == 0
    ep = json.loads(capsys.readouterr().out)["comm"]["ep"]
    assert ep["degree"] == 4 and 0.001 < ep["exposed"] < ep["seconds"] / 2
    assert cli.main(args) == 0
    cells = _row(capsys.readouterr().out, "ep")
    assert cells[:7] == ["ep", "4", ep["level"], f"{ep['bandwidth'] / 1e9:,.0f}",
                         f"{ep['bytes'] / 1e9:,.2f}", f"{ep['seconds']:.3f}",
                         f"{ep['exposed']:.3f}"], cells
    assert cells[7].startswith("all-to-all dispatch + combine")
    assert cli.main(["plan", "layout", "--model", "llama3-8b"]) == 0
    text = capsys.readouterr().out
    assert _row(text, "dp") and not _row(text, "ep")


def test_plan_search_json_and_table(capsys):
    args = ["plan", "search", "--model", "llama3-8b", "--cluster", "h100-server",
            "--global-batch", "64", "--seq-len", "8192", "--zero", "1,3", "--top", "3"]
    assert cli.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["plans"]) == 3 and out["n_gpus"] == 8
    steps = [p["step_time"] for p in out["plans"]]
    assert steps == sorted(steps)
    assert out["rejected_counts"]["memory"] == sum(
        r["reason"].startswith("memory") for r in out["rejected"]) > 0
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "best layouts" in text and "rejected, by reason: memory" in text


def test_plan_validate_and_presets(capsys):
    assert cli.main(["plan", "validate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["narayanan_2021_table1"]) == 10 and len(out["llama3_table4"]) == 3
    assert out["narayanan_2021_table1"][-1]["published_tflops"] == 163
    assert cli.main(["plan", "presets", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clusters"]["llama3-24k"]["gpus"] == 24576 and "megatron-1t" in out["models"]
    assert cli.main(["plan", "validate"]) == 0
    assert "Table 1" in capsys.readouterr().out


@pytest.mark.parametrize("args,words", [
    (["plan", "layout", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["plan", "layout", "--cluster", "frontier"], "unknown cluster 'frontier'"),
    (["plan", "layout", "--tp", "3"], "tp=3 does not divide n_heads=32"),
    (["plan", "layout", "--dp", "2", "--global-batch", "7"], "global_batch=7"),
    (["plan", "layout", "--checkpoint", "often"], "checkpoint must be"),
    (["plan", "layout", "--tp", "8", "--dp", "2"], "16 GPUs; h100-server has 8"),
    (["plan", "search", "--gpus", "9"], "n_gpus must be in 1..8"),
    (["plan", "search", "--runtime", "jax"], "unknown runtime 'jax'"),
    (["plan", "search", "--zero", "1,5"], "zero stages must be among 0, 1, 2, 3, got [1, 5]"),
    (["plan", "layout", "--zero", "5"], "zero must be 0, 1, 2 or 3, got 5"),
    (["plan", "layout", "--schedule", "zb"], "schedule must be one of gpipe, 1f1b, interleaved"),
])
def test_plan_bad_input_is_error_exit_2(capsys, args, words):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err


@pytest.mark.parametrize("args", [["plan", "layout", "--memory-limit", "80XB"],
                                  ["plan", "search", "--tp", "2,x"],
                                  ["plan", "layout", "--tp", "two"]])
def test_plan_unparsable_values_exit_2(capsys, args):
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2 and "error: argument" in capsys.readouterr().err
