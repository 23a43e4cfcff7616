"""Lending a warm session cluster to code that starts its own: ``labkit run`` and ``labkit
bench`` open ``with Cluster(...) as cluster`` (imported from :mod:`labkit.cluster` when
they run). Inside :func:`lend`, that ``Cluster(...)`` records its arguments and yields the
session's pool, which stays open afterwards, so a test pays for the job, not for starting
ranks. The real start and close of an own cluster is checked once, through ``python -m
labkit run`` (tests/test_cli.py)."""
from __future__ import annotations

import contextlib

import pytest


class _Lent:
    """A session cluster lent to ``with Cluster(...) as cluster``; not closed on exit."""

    def __init__(self, cluster):
        self.cluster = cluster

    def __enter__(self):
        return self.cluster

    def __exit__(self, *exc):
        return None


@contextlib.contextmanager
def lend(cluster):
    """Within the block, ``labkit.cluster.Cluster(*args, **kwargs)`` lends ``cluster``;
    yields the list of ``(args, kwargs)`` it was called with. Not under torchrun."""
    import labkit.cluster

    asked: list = []

    def borrow(*args, **kwargs):
        asked.append((args, kwargs))
        return _Lent(cluster)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(labkit.cluster, "Cluster", borrow)
        for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
            mp.delenv(k, raising=False)
        yield asked
