"""The small checks every rule of :mod:`labkit.validate` shares: an int or a finite number
in range, a field's dataclass default, and the refusal of a field that would be ignored.

Each raises a plain ``ValueError`` naming the field and the value;
:func:`labkit.validate.validate_run` turns it into a ``ConfigError``. Pure Python (no torch).
"""
from __future__ import annotations

import dataclasses
import math


def _int(cfg, name: str, low: int = 1) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")


def _number(v, name: str, low: float, strict: bool) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or (v <= low if strict else v < low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, "
                         f"got {v!r}")


def default(cfg, name: str):
    """The default of field ``name`` of ``cfg``'s dataclass (what "left alone" means)."""
    f = {f.name: f for f in dataclasses.fields(cfg)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _refuse_unless(cfg, cond: bool, names: tuple, why: str) -> None:
    """Refuse a non-default value of any of ``names`` unless ``cond``: a field that would
    be ignored is an error, never a silent no-op."""
    if cond:
        return
    for name in names:
        v = getattr(cfg, name)
        if v != default(cfg, name):
            raise ValueError(f"{name}={v!r} has no effect here: {why}")
