"""``labkit run | plan | bench``: the notebook's jobs from a terminal, or under torchrun.

* ``labkit run --dp 2 --zero 3 --pp 2 --microbatches 4 --steps 3`` trains one
  :class:`~labkit.config.RunConfig` with :func:`labkit.jobs.train` on its own
  :class:`labkit.Cluster` of ``dp·tp·pp·cp`` ranks and prints the mesh, memory by category
  and bytes per mesh axis and collective per rank (measured beside predicted), MFU/HFU, the
  loss and, with ``--pp``, the bubble (:mod:`.report`, :mod:`.pipeline`). Every flag sets
  one ``RunConfig`` field (:data:`.run.FLAGS`); ``--json`` prints plain data, ``--trace``
  writes the Chrome trace.
* ``torchrun --nproc-per-node 2 -m labkit run --dp 2 ...`` runs the same job in torchrun's
  workers (the degrees multiply to ``WORLD_SIZE``); rank 0 prints the same report
  (:mod:`.launch`).
* ``labkit plan memory --params 7.5e9 --ranks 64 --zero 3``: model-state bytes per rank
  ``labkit plan layout | search | validate | presets``: :mod:`labkit.plan.cli`.
* ``labkit bench collectives ...``: :mod:`labkit.collectives.bench` (:mod:`.bench`).

Bad input is one line ``error: ...`` naming the field and the numbers, exit code 2, before
any process starts. Only torch-free modules load before the input is validated.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from . import bench
from .common import Parser, UsageError, print_error, under_torchrun
from .launch import cmd_run
from ..plan.cli import add_plan_parser
from .run import add_run_arguments

__all__ = ["main", "build_parser", "under_torchrun", "UsageError"]


def build_parser(bench_module=None) -> Parser:
    """The argument parser; ``bench_module`` is the imported collectives bench, if any."""
    from .. import __version__

    p = Parser(prog="labkit", description="labkit: run, plan and benchmark distributed "
               "training on a local cluster or under torchrun.")
    p.add_argument("--version", action="version", version=f"labkit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{run,plan,bench}", required=True)
    r = sub.add_parser("run", help="train any composition of dp/ZeRO/pp; per-rank metrics",
                       description="Train one RunConfig (every flag sets one field; left out, "
                       "the field keeps its default) on an own local cluster of "
                       "dp x tp x pp x cp ranks, or in torchrun's workers, and print "
                       "measured beside predicted.")
    add_run_arguments(r)
    r.set_defaults(func=cmd_run)
    add_plan_parser(sub)
    bench.add_bench_parser(sub, bench_module)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``labkit`` console script; returns the exit code.

    Run as a script under torchrun (``argv`` None), a rank ends with ``os._exit`` once its
    output is flushed: the process group is already destroyed, and skipping the
    interpreter's teardown avoids an abort ("terminate called without an active
    exception", SIGABRT) that gloo's C++ threads cause there in a few percent of runs.
    """
    rc = _main(argv)
    if argv is None and under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _main(argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    module = None
    if bench.wants_bench(argv):
        module = bench.load()
        if module is None:
            return bench.unavailable()
    args = build_parser(module).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print_error(str(exc))
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
