"""tools/mutants.py stays in step with the code it mutates, checked without running a mutant.

``make mutants`` reports a mutant whose original text is gone as stale, but it is not part
of CI; after a refactor (a module split, a renamed line) a stale mutant would otherwise go
unnoticed until someone runs it. Here, for every mutant: its file exists, its original text
occurs in it exactly once, the planted file still parses (a mutant that only breaks the
syntax would be caught by any test and prove nothing), and every test it names exists.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants() -> list:
    spec = importlib.util.spec_from_file_location("labkit_mutants", ROOT / "tools" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod.MUTANTS


MUTANTS = _mutants()


def test_mutant_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_mutant_text_occurs_once_and_plants_valid_code(m):
    path = ROOT / m.file
    assert path.is_file(), f"mutant {m.name}: {m.file} does not exist (moved or split?)"
    text = path.read_text()
    n = text.count(m.old)
    assert n == 1, (f"mutant {m.name}: its original text occurs {n} times in {m.file} "
                    f"(must be exactly once; update the mutant after the refactor): "
                    f"{m.old!r}")
    assert m.new != m.old, f"mutant {m.name}: the replacement equals the original"
    if path.suffix == ".py":
        try:
            ast.parse(text.replace(m.old, m.new), filename=m.file)
        except SyntaxError as e:
            pytest.fail(f"mutant {m.name}: the planted {m.file} does not parse (line "
                        f"{e.lineno}: {e.msg}); a syntax error proves nothing about the tests")


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_mutant_tests_exist(m):
    assert m.tests, f"mutant {m.name} names no test"
    for sel in m.tests:
        head = sel.partition(" -k ")[0].strip()
        file, _, node = head.partition("::")
        path = ROOT / file
        assert path.is_file(), f"mutant {m.name}: test file {file} does not exist"
        if node:  # "test_x[param]" or "Class::test_x": the function must be defined there
            func = re.sub(r"\[.*\]$", "", node.split("::")[-1])
            assert re.search(rf"^\s*def {re.escape(func)}\(", path.read_text(), re.M), \
                f"mutant {m.name}: {file} defines no {func} (renamed?)"
