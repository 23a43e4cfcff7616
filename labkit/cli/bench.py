"""``labkit bench collectives``: :mod:`labkit.collectives.bench`'s sweep, loaded on use.

The bench module defines its own options (``add_arguments``) and entry (``main``); it is
imported only when the command line asks for it, and a build without it says so.
"""
from __future__ import annotations

import importlib
import sys

__all__ = ["BENCH_MODULE", "wants_bench", "load", "add_bench_parser", "unavailable"]

BENCH_MODULE = "labkit.collectives.bench"


def wants_bench(argv) -> bool:
    """True when ``argv`` (without the program) names ``bench collectives``."""
    return [a for a in argv if not a.startswith("-")][:2] == ["bench", "collectives"]


def load():
    """The bench module, or ``None`` when this build has none."""
    try:
        return importlib.import_module(BENCH_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name in ("labkit.collectives", BENCH_MODULE):
            return None
        raise


def unavailable(args=None) -> int:
    print("labkit bench collectives is not available in this build", file=sys.stderr)
    return 2


def add_bench_parser(subparsers, module=None) -> None:
    """Add ``bench collectives``: ``module``'s own options when loaded, else a stub."""
    b = subparsers.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="what", metavar="{collectives}", required=True)
    c = bsub.add_parser("collectives", help="collective bandwidth (algbw/busbw) sweep")
    if module is not None:
        module.add_arguments(c)
        c.set_defaults(func=module.main)
    else:
        c.set_defaults(func=unavailable)
