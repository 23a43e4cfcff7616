"""``labkit plan search``: every layout of a model on ``n`` GPUs, the best ones that fit.

Enumerates the degrees ``tp · cp · pp · dp = n`` and the knobs (ZeRO stage, microbatch,
schedule and model chunks, recomputation), estimates each (:func:`labkit.plan.estimate`),
and returns the layouts that fit the memory limit ranked by step time — for a fixed model,
batch and GPU count, the same order as MFU — together with every rejected layout and the
reason it failed: a divisibility rule the model or the batch breaks (naming the numbers),
or the memory it needs.

Recomputation is tried cheapest first (none, selective, full): once a policy fits, the
slower ones are *dominated* — same layout, more compute — and are counted, not estimated.
GPipe is left out by default for the same reason (1F1B has its bubble with less memory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Union

from labkit.plan.estimate import Plan, estimate
from labkit.plan.hardware import ClusterSpec, cluster_preset
from labkit.plan.layout import CHECKPOINTS, Layout
from labkit.plan.models import PlanModel, plan_model
from labkit.plan.runtime import Runtime, runtime_preset

__all__ = ["Rejected", "SearchResult", "search", "degree_choices", "reason_kind"]


@dataclass(frozen=True)
class Rejected:
    """A layout that cannot be used, and why."""

    layout: Layout
    reason: str


@dataclass(frozen=True)
class SearchResult:
    """Fitting plans best first (``plans``), the rejected layouts with reasons, and how
    many were considered and dominated."""

    plans: list
    rejected: list
    considered: int
    dominated: int
    n_gpus: int
    fitting: int = 0
    notes: list = field(default_factory=list)

    @property
    def best(self) -> Optional[Plan]:
        return self.plans[0] if self.plans else None

    def reason_counts(self) -> dict[str, int]:
        """Rejections grouped by kind (``"memory"``, ``"global_batch"``, ``"tp"``, …)."""
        out: dict[str, int] = {}
        for r in self.rejected:
            key = reason_kind(r.reason)
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def reason_kind(reason: str) -> str:
    """A short name for a rejection: ``memory``, the field it names (``global_batch``,
    ``tp``, ``cp``, ...), ``interleaved`` or ``layers``."""
    if reason.startswith("memory"):
        return "memory"
    if reason.startswith("the interleaved"):
        return "interleaved"
    if reason.startswith("pp x virtual_stages"):
        return "layers"
    head = reason.split(" ", 1)[0]
    return head.split("=", 1)[0].rstrip(":,") or "other"


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def degree_choices(model: PlanModel, cluster: ClusterSpec, n_gpus: int,
                   tp: Optional[Iterable[int]] = None, cp: Optional[Iterable[int]] = None,
                   pp: Optional[Iterable[int]] = None, dp: Optional[Iterable[int]] = None
                   ) -> list[tuple[int, int, int, int]]:
    """``(tp, cp, pp, dp)`` with product ``n_gpus``. Defaults: ``tp`` powers of two up to
    twice a server (one step across the server boundary, to show what it costs), on a torus
    up to its first axis; ``cp``
    powers of two keeping at least 1,024 tokens per rank; ``pp`` any divisor up to the
    layer count."""
    # a torus has no server boundary: tensor parallelism may fill its first axis
    cap = cluster.torus[0] if cluster.torus else 2 * cluster.gpus_per_node
    tps = list(tp) if tp else _powers_of_two(min(n_gpus, cap))
    cps = list(cp) if cp else [c for c in _powers_of_two(64) if model.seq_len // c >= 1024
                               or c == 1]
    out = []
    for t in tps:
        for c in cps:
            if n_gpus % (t * c):
                continue
            rest = n_gpus // (t * c)
            pps = list(pp) if pp else [q for q in range(1, min(rest, model.n_layers) + 1)
                                       if rest % q == 0]
            for q in pps:
                if rest % q:
                    continue
                d = rest // q
                if dp and d not in set(dp):
                    continue
                out.append((t, c, q, d))
    return out


def search(model: Union[str, PlanModel], cluster: Union[str, ClusterSpec],
           n_gpus: Optional[int] = None, global_batch: int = 1024,
           seq_len: Optional[int] = None, *, runtime: Union[str, Runtime] = "llama3-2024",
           memory_limit: Optional[float] = None, top: int = 10,
           tp: Optional[Iterable[int]] = None, cp: Optional[Iterable[int]] = None,
           pp: Optional[Iterable[int]] = None, dp: Optional[Iterable[int]] = None,
           zero: Iterable[int] = (1, 2, 3), microbatch: Iterable[int] = (1, 2, 4),
           checkpoint: Iterable[str] = CHECKPOINTS,
           schedules: Iterable[str] = ("1f1b", "interleaved"),
           virtual_stages: Iterable[int] = (2, 4), sequence_parallel: bool = True
           ) -> SearchResult:
    """The best layouts of ``model`` on ``n_gpus`` GPUs of ``cluster`` (all of it when
    ``None``) for ``global_batch`` sequences of ``seq_len`` tokens.

    Returns:
        a :class:`SearchResult`: ``plans`` (at most ``top``, fastest first, with terms),
        ``rejected`` (every layout that failed, with its reason).

    Raises:
        ValueError: unknown presets or runtime, ``n_gpus`` outside ``1 … cluster size``, a
            ``global_batch`` below 1, an unknown recomputation policy or schedule.
    """
    m = plan_model(model, seq_len)
    c = cluster_preset(cluster)
    runtime = runtime_preset(runtime)
    n = c.n_gpus if n_gpus is None else n_gpus
    if isinstance(n, bool) or int(n) != n or not 1 <= n <= c.n_gpus:
        raise ValueError(f"n_gpus must be in 1..{c.n_gpus} for {c.name}, got {n_gpus!r}")
    if isinstance(global_batch, bool) or int(global_batch) != global_batch or global_batch < 1:
        raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
    policies = [k for k in CHECKPOINTS if k in set(checkpoint)]
    if not policies or set(checkpoint) - set(CHECKPOINTS):
        raise ValueError(f"checkpoint must be a subset of {CHECKPOINTS}, got {checkpoint!r}")
    bad = set(schedules) - {"gpipe", "1f1b", "interleaved"}
    if bad or not list(schedules):
        raise ValueError(f"unknown schedule(s) {sorted(bad)}; known: gpipe, 1f1b, interleaved")
    zero, microbatch, virtual_stages = list(zero), list(microbatch), list(virtual_stages)
    if not zero or set(zero) - {0, 1, 2, 3}:
        raise ValueError(f"zero stages must be among 0, 1, 2, 3, got {zero}")
    for name, vals in (("microbatch", microbatch), ("virtual_stages", virtual_stages),
                       ("tp", tp or [1]), ("cp", cp or [1]), ("pp", pp or [1]),
                       ("dp", dp or [1])):
        vals = list(vals)
        if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                           for v in vals):
            raise ValueError(f"{name} choices must be positive ints, got {vals}")
    fitting, rejected, considered, dominated = [], [], 0, 0
    for t, cc, q, d in degree_choices(m, c, int(n), tp, cp, pp, dp):
        scheds = [("1f1b", 1)] if q == 1 else \
            [(s, 1) for s in schedules if s != "interleaved"] + \
            ([("interleaved", v) for v in virtual_stages] if "interleaved" in schedules else [])
        for z in zero:
            for b in microbatch:
                for sched, v in scheds:
                    for i, ck in enumerate(policies):
                        lay = Layout(tp=t, cp=cc, pp=q, dp=d, zero=z, microbatch=b,
                                     global_batch=int(global_batch), seq_len=m.seq_len,
                                     schedule=sched, virtual_stages=v, checkpoint=ck,
                                     sequence_parallel=sequence_parallel)
                        considered += 1
                        try:
                            p = estimate(m, c, lay, runtime, memory_limit, timing=False,
                                         detail=False)
                        except ValueError as exc:
                            rejected.append(Rejected(lay, str(exc)))
                            break  # a divisibility rule: every policy fails the same way
                        if not p.fits:
                            rejected.append(Rejected(lay, p.reasons[0]))
                            continue
                        fitting.append(lay)
                        dominated += len(policies) - i - 1
                        considered += len(policies) - i - 1
                        break
    timed = [estimate(m, c, lay, runtime, memory_limit, detail=False) for lay in fitting]
    timed.sort(key=lambda p: p.step_time)
    best = [estimate(m, c, p.layout, runtime, memory_limit) for p in timed[:max(0, top)]]
    return SearchResult(best, rejected, considered, dominated, int(n), len(fitting))
