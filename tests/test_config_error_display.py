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
