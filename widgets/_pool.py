"""What a view does before it runs a job: find the current pool, say when a click must wait.

Two hooks every view that drives a :class:`labkit.Cluster` uses (the explorer and the
pipeline view can call the same):

* :func:`current_cluster` — the cluster a run goes to. Re-running a notebook's
  ``Cluster(4)`` cell replaces the pool; a view built before still holds the old object,
  whose ``current`` is the new one.
* :func:`run_job` — run a job from a control's callback: the status line says
  "starting ranks…" while a cold pool (just created, restarted after a fault, or closed)
  starts, so the first click never looks frozen, and notes when the view follows a
  newer cluster.

Anything with ``world_size`` and ``run(job, config)`` works (test doubles have neither
``current`` nor ``ready``, and count as warm).
"""
from __future__ import annotations

from typing import Any, Optional

from . import _style as S

__all__ = ["current_cluster", "must_start", "prepare", "run_job", "STARTING"]

#: status text while a click waits for rank processes to start
STARTING = "starting ranks… (a fresh pool imports torch on every rank: a few seconds, once)"


def current_cluster(cluster):
    """The cluster a run goes to: ``cluster.current`` when it has one (a replaced
    :class:`labkit.Cluster` forwards to its successor), else ``cluster`` itself."""
    return getattr(cluster, "current", cluster) if cluster is not None else None


def must_start(cluster) -> bool:
    """True when a run on ``cluster`` has to wait for rank processes to start first."""
    c = current_cluster(cluster)
    ready = getattr(c, "ready", None)
    if ready is None:
        return False
    try:
        return not ready()
    except Exception:  # noqa: BLE001 - a failed start: the run itself raises it, in words
        return True


def prepare(cluster, status=None, busy: Optional[str] = None) -> tuple:
    """Before a run: ``(cluster to run on, note)``; ``status`` says "starting ranks…"
    when the pool is cold, else ``busy`` (if given). The note is "" or says the view
    follows a newer cluster and/or that ranks had to start (for the status after the run).
    """
    c = current_cluster(cluster)
    cold = must_start(c)
    if status is not None and (cold or busy):
        status.value = S.status_html(STARTING if cold else busy, "busy")
    notes = []
    if c is not cluster:
        notes.append("following the newer cluster (the one this view was given was replaced)")
    if cold:
        notes.append("the ranks were started first")
    return c, "; ".join(notes)


def run_job(cluster, job, config: Any = None, *, status=None, busy: Optional[str] = None,
            **run_kwargs):
    """``current_cluster(cluster).run(job, config, **run_kwargs)``, telling ``status``
    (an ``ipywidgets.HTML``) what the click waits for.

    The status shows :data:`STARTING` when the pool is cold, else ``busy`` (if given).
    The kernel sends each status change to the browser at once, so the text is on screen
    while ``run`` blocks. Whatever ``run`` raises is raised; the caller shows it.

    Returns:
        ``(result, note)``: the ``RunResult`` and a short note for the status line
        ("" or "on a freshly started pool" / "following the newer Cluster(...)").
    """
    c, note = prepare(cluster, status, busy)
    return c.run(job, config, **run_kwargs), note
