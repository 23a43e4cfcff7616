"""A configuration labkit refuses shows, in IPython, as ``ConfigError: <sentence>`` alone —
no traceback, no labkit frames — and still fails the cell (an exception, seen by nbval).
Run in an in-process IPython ``InteractiveShell`` (the shell a notebook kernel subclasses)."""
from __future__ import annotations

import re

import pytest

import labkit as lk
from labkit.validate import ConfigError

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    cfg = Config()
    cfg.HistoryManager.enabled = False  # no history database in the user's home
    sh = InteractiveShell.instance(config=cfg, colors="nocolor")
    try:
        yield sh
    finally:
        InteractiveShell.clear_instance()


def _run(shell, capsys, code: str):
    result = shell.run_cell(code)
    out = capsys.readouterr()
    return result, ANSI.sub("", out.out + out.err)


def test_a_refused_configuration_shows_its_sentence_alone(shell, capsys):
    shell.run_cell("import labkit as lk")
    result, text = _run(shell, capsys, "lk.RunConfig(global_batch=6).replace(dp=4)"
                                       ".validate(world_size=4)")
    assert not result.success  # still an exception: the cell fails, nbval sees it
    err = result.error_in_exec
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    sentence = "global_batch=6 is not divisible by dp=4"
    assert sentence in str(err)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert lines == [f"ConfigError: {err}"], text
    assert "Traceback" not in text and "validate.py" not in text and "config.py" not in text


def test_other_errors_keep_their_traceback(shell, capsys):
    # the renderer belongs to ConfigError only: a bug elsewhere still shows its frames
    result, text = _run(shell, capsys, "def f():\n    raise ValueError('boom')\nf()")
    assert isinstance(result.error_in_exec, ValueError)
    assert "Traceback" in text and "----> 3 f()" in text.replace("\u001b", "")


def test_every_rule_raises_config_error_and_except_valueerror_still_catches_it():
    bad = [lk.RunConfig(global_batch=6).replace(dp=4),                # batch
           lk.RunConfig().replace(zero_stage=5),                      # a field
           lk.RunConfig().replace(prefetch=False)]                    # composition
    for cfg in bad:
        with pytest.raises(ConfigError) as info:
            cfg.validate(4)
        assert info.value.__suppress_context__ and isinstance(info.value.__context__,
                                                               ValueError)
        try:
            cfg.validate(4)
        except ValueError as exc:  # notebooks and widgets catch ValueError
            assert type(exc) is ConfigError


def test_preflight_refusals_are_config_errors_shown_alone(shell, capsys, tmp_path):
    """Preflight's refusals (too many CPU ranks, an output path that cannot be written, a
    model that cannot fit memory) and the Cluster's own argument checks are ConfigErrors:
    in IPython the sentence alone, no preflight or cluster frames; still ValueErrors."""
    from labkit import preflight

    too_many = preflight.MAX_RANKS_PER_CORE * preflight.cpu_cores() + 1
    shell.run_cell("import labkit as lk")
    for code, sentence in (
            (f"lk.Cluster(world_size={too_many})",
             f"world_size={too_many} would start {too_many} rank processes"),
            ("lk.Cluster(world_size=0)", "world_size must be a positive int, got 0"),
            ("lk.Cluster(world_size=4, nodes=3)", "nodes=3 must divide world_size=4")):
        result, text = _run(shell, capsys, code)
        err = result.error_in_exec
        assert type(err) is ConfigError and sentence in str(err), (code, err)
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        assert lines == [f"ConfigError: {err}"], text
        assert "Traceback" not in text and "preflight.py" not in text, text

    big = lk.RunConfig(global_batch=too_many).replace(dp=too_many)
    folder = tmp_path / "out"
    folder.mkdir()
    for call, sentence in (
            (lambda: preflight.check_run_fits(big),
             f"dp={too_many} would start {too_many} rank processes"),
            (lambda: preflight.check_output_path(str(folder), "--json"), "that is a folder"),
            (lambda: preflight.check_output_path(str(folder / "no" / "t.json"), "--trace"),
             "does not exist"),
            (lambda: preflight.check_model_state_fits(1e18, "model huge"),
             "model huge needs about 1000000000.0 GB before activations")):
        with pytest.raises(ConfigError, match=re.escape(sentence)):
            call()
