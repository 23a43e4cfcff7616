"""docs/claims.md stays true: every test it cites exists, every claim id cited in the tests
or the notebooks has its row, and no row says "not yet" where a test now checks the claim.

Test names are collected from the test files' syntax trees (``ast``), not by running them.
"""
import ast
import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "claims.md"
CITE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`")
ROW = re.compile(r"^\| (C\d+) \|", re.M)
ID = re.compile(r"\bC(\d{1,2})\b")


@functools.lru_cache(maxsize=None)
def _test_names(path: Path) -> set:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))}


def _rows() -> dict:
    text = DOC.read_text()
    out = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = line
    return out


def _cited_ids() -> dict:
    """Claim ids cited in tests/*.py and in notebooks' cells, with one place each."""
    out = {}
    for p in sorted((ROOT / "tests").glob("*.py")):
        for m in ID.finditer(p.read_text()):
            out.setdefault(f"C{int(m.group(1))}", p.name)
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(p.read_text())["cells"]:
            for m in ID.finditer("".join(cell["source"])):
                out.setdefault(f"C{int(m.group(1))}", p.name)
    return out


def test_every_cited_test_exists():
    missing, last = [], None
    for line in DOC.read_text().splitlines():
        for m in CITE.finditer(line):
            path, name, short = m.groups()
            if path:
                last = ROOT / path
                if not last.exists():
                    missing.append(path)
                    continue
            if short and last is None:
                missing.append(f"::{short} with no file before it")
                continue
            name = name or short
            if name and name not in _test_names(last):
                missing.append(f"{last.relative_to(ROOT)}::{name}")
    assert not missing, missing


def test_every_cited_claim_id_has_its_row():
    rows = _rows()
    assert list(rows) == [f"C{i}" for i in range(1, len(rows) + 1)]  # in order, no gaps
    lost = {cid: where for cid, where in _cited_ids().items() if cid not in rows}
    assert not lost, lost


def test_no_row_says_not_yet_where_a_test_cites_the_claim():
    """A row may say "not yet" about a notebook still planned, but not while a test that
    asserts the claim exists and the row cites no test at all."""
    cited = {}
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        for m in re.finditer(r"claims? (C\d+(?:(?:, | and |–)C\d+)*)", p.read_text()):
            for cid in re.findall(r"C\d+", m.group(1)):
                cited.setdefault(cid, p.name)
    stale = [cid for cid, line in _rows().items()
             if cid in cited and "tests/" not in line
             and re.search(r"not yet|no test yet", line, re.I)]
    assert not stale, {cid: cited[cid] for cid in stale}
