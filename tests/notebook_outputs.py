"""Reading a notebook's stored outputs: the notebook tests check what a ``# NBVAL_CHECK_OUTPUT``
cell printed when it was stored (tools/store_checked_outputs.py), and nbval checks that a
fresh run prints the same."""
from __future__ import annotations

import nbformat

MARK = "NBVAL_CHECK_OUTPUT"


def code_cells(path) -> list:
    """The notebook's code cells as stored (the ``cells`` fixture of tests/conftest.py
    reads the test module's ``NB``)."""
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def assert_only_checked_cells_store_output(cells, at_least: int) -> None:
    """At least ``at_least`` checked cells, each storing printed text and nothing else;
    every other code cell stores no output (nbval would not compare it)."""
    marked = checked(cells)
    assert len(marked) >= at_least, f"{len(marked)} checked cells, expected >= {at_least}"
    for c in marked:
        assert text(c).strip(), f"checked cell without stored output:\n{c.source[:200]}"
        assert all(o.get("output_type") == "stream" for o in c.outputs), c.source[:200]
    for c in cells:
        if MARK not in c.source:
            assert not c.outputs, f"unchecked cell with stored output:\n{c.source[:200]}"


def text(cell) -> str:
    """The cell's stored stream output (what it printed)."""
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def checked(cells) -> list:
    """The code cells whose output nbval checks."""
    return [c for c in cells if MARK in c.source]


def checked_output(cells, needle: str) -> str:
    """The stored output of the one checked cell whose source contains ``needle``."""
    found = [c for c in checked(cells) if needle in c.source]
    assert len(found) == 1, f"expected one checked cell containing {needle!r}, got {len(found)}"
    return text(found[0])
