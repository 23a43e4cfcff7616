"""Prose and screen agree: a notebook sentence about a value shown beside it, asserted.

A notebook's markdown says what the reader will see ("the cp traffic halves", "the view
shows the last step"). A ``# PROSE_CHECK`` code cell right after it calls :func:`check` once
per such sentence with a phrase quoted from it and the condition that makes it true, computed
from the same variables (or the view's state) the screen shows. nbval runs every cell in CI,
so a sentence that stops being true fails the build; the reader sees one line per claim,
``✓ checked: <phrase>``. ``tests/test_notebook_prose.py`` checks that each quoted phrase is
in the markdown just above and that every sentence stating a value relation is quoted.
"""
from __future__ import annotations

__all__ = ["check", "MARK"]

#: first line of a cell whose checks the prose test reads
MARK = "# PROSE_CHECK"


def check(claim: str, ok: bool, shown=None) -> None:
    """Print ``✓ checked: claim`` if ``ok``, else raise.

    Args:
        claim: a phrase quoted verbatim from the markdown cell above (the test matches it).
        ok: the relation the phrase states, evaluated on the values on screen.
        shown: the values it was evaluated on, for the error message.

    Raises:
        AssertionError: ``ok`` is false: the prose no longer says what the screen shows.
    """
    claim = " ".join(claim.split())   # the phrase as the reader sees it, one line
    if not ok:
        raise AssertionError(f"the prose says {claim!r}, but the values on screen disagree"
                             + ("" if shown is None else f": {shown!r}"))
    print("✓ checked:", claim)
