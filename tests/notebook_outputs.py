"""Reading a notebook's stored outputs: the notebook tests check what a ``# NBVAL_CHECK_OUTPUT``
cell printed when it was stored (tools/store_checked_outputs.py), and nbval checks that a
fresh run prints the same."""
from __future__ import annotations

MARK = "NBVAL_CHECK_OUTPUT"


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
