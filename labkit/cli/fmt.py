"""Cells and the console the ``labkit`` tables share (``rich`` is imported on use)."""
from __future__ import annotations

import sys

__all__ = ["MiB", "DASH", "pair", "mib", "pct", "make_console"]

MiB = 2 ** 20
#: a value that does not exist (nothing measured, nothing predicted, nothing gathered)
DASH = "—"


def make_console():
    """A rich ``Console``: tables 200 columns wide when piped (CI logs, tests), the
    terminal's width otherwise; text lines are not wrapped (a grep finds a whole note),
    and square brackets are text, not markup."""
    from rich.console import Console

    return Console(highlight=False, markup=False, soft_wrap=True,
                   width=None if sys.stdout.isatty() else 200)


def pair(measured, predicted, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    """``"measured / predicted"`` scaled by ``1/scale``, ``DASH`` for a missing side."""
    a = DASH if measured is None else fmt.format(measured / scale)
    b = DASH if predicted is None else fmt.format(predicted / scale)
    return f"{a} / {b}"


def mib(v) -> str:
    """Bytes as MiB with 3 decimals, or ``DASH``."""
    return DASH if v is None else f"{v / MiB:.3f}"


def pct(v) -> str:
    """A fraction as a percentage with 2 decimals, or ``DASH``."""
    return DASH if v is None else f"{100 * v:.2f}"
