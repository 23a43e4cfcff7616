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

__all__ = ["check", "MARK", "trend"]

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


def trend(values: dict, key: str = "M", places: int = 3) -> str:
    """How ``values`` move along their keys, in the words of a *reading* line.

    Args:
        values: ``{key value: reading}`` in the order measured (e.g. ``{1: 0.5, 2: 0.272,
            4: 0.277, 8: 0.244}``).
        key: the name of the keys in the words (``"M=2"``).
        places: readings are compared as printed, rounded to this many decimals, so the
            words never call two equal printed numbers a rise or a fall.

    Returns:
        One clause: ``"falls at every step from M=1 to M=8"`` when every step falls (or
        rises, or stays), else each run of steps in one direction and where the lowest
        reading is: ``"falls from M=1 to M=2, rises to M=4, falls to M=8; lowest at M=8"``.

    Raises:
        ValueError: fewer than two readings (nothing moves).
    """
    keys = list(values)
    if len(keys) < 2:
        raise ValueError(f"trend needs two readings or more, got {len(keys)}: {values!r}")
    v = {k: round(values[k], places) for k in keys}
    runs: list = []  # [word, first key, last key]: consecutive steps in one direction
    for a, b in zip(keys, keys[1:]):
        word = "falls" if v[b] < v[a] else "rises" if v[b] > v[a] else "stays level"
        if runs and runs[-1][0] == word:
            runs[-1][2] = b
        else:
            runs.append([word, a, b])
    if len(runs) == 1:
        return f"{runs[0][0]} at every step from {key}={keys[0]} to {key}={keys[-1]}"
    low = min(v[k] for k in keys)
    lowest = " and ".join(f"{key}={k}" for k in keys if v[k] == low)
    steps = [f"{w} from {key}={a} to {key}={b}" if i == 0 else f"{w} to {key}={b}"
             for i, (w, a, b) in enumerate(runs)]
    return ", ".join(steps) + f"; lowest at {lowest}"
