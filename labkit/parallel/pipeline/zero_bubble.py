"""Pipeline schedules with the backward split into ``B`` (input gradient) and ``W`` (weight
gradient), so a ``W`` can fill a gap: ZB-H1, ZB-V and DualPipeV.

Pure generators of per-rank :class:`~.actions.Action` lists (the data model and the other
schedules: :mod:`.schedules`). Sources: ZB-H1 and ZB-V — Qi et al. 2023, "Zero Bubble
Pipeline Parallelism" §3 and §6; DualPipeV — DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report" §3.2.1 (DualPipe), in the V form of deepseek-ai/DualPipe and
``torch.distributed.pipelining.ScheduleDualPipeV``.
"""
from __future__ import annotations

from .actions import Action, Schedule
from .full_backward import _check

__all__ = ["zb_h1", "zb_v", "dualpipe_v"]


def _greedy(name: str, p: int, m: int, v: int, style: str, caps: list) -> Schedule:
    """List-schedule F/B/W with unit costs: a free rank runs a ready ``B`` first (it is on
    the critical path), else a ready ``F`` if fewer than ``caps[r]`` stage-microbatches are
    in flight on it (activation memory bound), else a pending ``W`` (which can move because
    nothing downstream waits for it — Qi et al. 2023 §2). Higher stages win ties. The
    per-rank order of the resulting feasible timeline is the schedule, so it cannot
    deadlock under any costs."""
    sched = Schedule(name, p, m, v, style, ())
    n = sched.n_stages
    local = [sched.stages_of(r) for r in range(p)]
    fdone, bdone = {}, {}
    nf, nb = [0] * n, [0] * n
    pend_w: list = [[] for _ in range(p)]
    inflight, free = [0] * p, [0] * p
    seqs: list = [[] for _ in range(p)]
    t, left = 0, 3 * n * m
    while left:
        for r in range(p):
            if free[r] > t:
                continue
            pick = None
            for s in sorted(local[r], reverse=True):  # B ready?
                i = nb[s]
                if i < nf[s] and fdone.get((s, i), 1e9) <= t and (
                        s == n - 1 or bdone.get((s + 1, i), 1e9) <= t):
                    pick = Action(s, "B", i)
                    break
            if pick is None and inflight[r] < caps[r]:
                for s in sorted(local[r], reverse=True):
                    i = nf[s]
                    if i < m and (s == 0 or fdone.get((s - 1, i), 1e9) <= t):
                        pick = Action(s, "F", i)
                        break
            if pick is None and pend_w[r]:
                pick = pend_w[r].pop(0)
            if pick is None:
                continue
            seqs[r].append(pick)
            free[r] = t + 1
            left -= 1
            s, i = pick.stage, pick.microbatch
            if pick.kind == "F":
                nf[s] += 1
                inflight[r] += 1
                fdone[(s, i)] = t + 1
            elif pick.kind == "B":
                nb[s] += 1
                bdone[(s, i)] = t + 1
                pend_w[r].append(Action(s, "W", i))
            else:
                inflight[r] -= 1
        t += 1
        if t > 10 * n * m + 10 * p:  # cannot happen for caps >= 1; guard against a bug
            raise RuntimeError(f"greedy schedule {name} did not finish (P={p}, M={m})")
    return Schedule(name, p, m, v, style, tuple(tuple(s) for s in seqs))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023 §3.1, Fig. 3 top): 1F1B with backward split into ``B`` and
    ``W``. Rank ``r`` runs 1F1B's ``P−1−r`` warm-up forwards, then ``F, B`` pairs, but
    starts its ``W`` passes ``r`` microbatches late, so in the cool-down the ``B`` chain runs
    at ``T_B`` per hop while the held-back ``W`` passes fill what would be idle time. Every
    rank holds at most ``P`` microbatches (1F1B's peak, on its rank 0). With
    ``T_F = T_B = T_W`` the idle per rank is ``(P−1)·(T_F + T_B − T_W)``, a third of 1F1B's
    ``(P−1)·(T_F + T_B + T_W)``."""
    _check(p, m)
    out, warm = [], []
    for r in range(p):
        w = min(p - 1 - r, m)
        seq = [Action(r, "F", i) for i in range(w)]
        nw = 0
        for i in range(m):
            if w + i < m:
                seq.append(Action(r, "F", w + i))
            seq.append(Action(r, "B", i))
            if i >= r:
                seq.append(Action(r, "W", nw))
                nw += 1
        seq += [Action(r, "W", k) for k in range(nw, m)]
        out.append(tuple(seq))
        warm.append(w)
    return Schedule("zb-h1", p, m, 1, "loop", tuple(out), warmup=tuple(warm))


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2023 §6): two stages per rank in a V — rank ``r`` holds stages ``r``
    and ``2P−1−r``, so the loss is computed on rank 0, next to the embedding — with split
    backward and at most ``2P`` half-size stage activations per rank (1F1B's peak memory)."""
    _check(p, m)
    s = _greedy("zb-v", p, m, 2, "v", [2 * p] * p)
    return Schedule(s.name, p, m, 2, "v", s.actions, warmup=_warmup_of(s.actions))


def dualpipe_v(p: int, m: int) -> Schedule:
    r"""DualPipeV (DeepSeek-V3 report §3.2.1, Fig. 5, folded into a V): rank ``r`` holds
    stages ``r`` (the way down, "chunk 0") and ``2P−1−r`` (the way back, "chunk 1"), as in
    ZB-V. Microbatches enter from rank 0 only (the V form of DualPipe's two directions), in
    eight phases per rank, each a fixed pattern repeated a number of times that depends on
    ``r``:

    1. ``2(P−1−r)`` forwards of chunk 0; 2. ``r+1`` pairs ``F0 F1``;
    3. ``P−1−r`` times ``B1 W F1`` (split backward: the ``W`` fills the gap);
    4. the steady state, ``M−2P+r+1`` times ``F0 BW1 F1 BW0``: each ``F`` is paired with a
       full backward of the other chunk (DualPipe overlaps the pair's compute with the
       other's communication; PyTorch's runtime and labkit's executor run the two in turn);
    5. ``P−1−r`` times ``BW1 F1 BW0``; 6. ``r+1`` pairs of backwards ``1, 0``, split into
       ``B`` from the middle pair on; 7. ``P−1−r`` times ``W B0``; 8. the last ``r+1``
       ``W``\s, oldest first.

    Full backwards in the steady state, split ones in the ramps: the ``W``\s move only where
    they fill a bubble. The per-rank order is the one ``ScheduleDualPipeV`` runs (torch 2.13,
    ``_calculate_single_rank_operations``, with each overlapped pair as its two actions),
    written here from that description.

    Raises:
        ValueError: ``M < 2P`` (DualPipe's ``num_chunks >= num_ranks * 2``; PyTorch refuses
            fewer microbatches than stages): the steady state would run a negative number
            of times.
    """
    _check(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipe-v needs microbatches >= 2 x pp = {2 * p} (one per stage: "
                         f"DualPipe's and PyTorch's ScheduleDualPipeV's limit), got "
                         f"microbatches={m} with pp={p}")
    out = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        nf, nb = {s0: 0, s1: 0}, {s0: 0, s1: 0}
        seq: list = []
        wq: list = []  # pending W, oldest first

        def f(s: int) -> None:
            seq.append(Action(s, "F", nf[s]))
            nf[s] += 1

        def b(s: int, split: bool) -> None:
            i = nb[s]
            nb[s] += 1
            seq.append(Action(s, "B" if split else "BW", i))
            if split:
                wq.append(Action(s, "W", i))

        def w() -> None:
            if wq:
                seq.append(wq.pop(0))

        for _ in range(2 * (p - 1 - r)):
            f(s0)
        for _ in range(r + 1):
            f(s0)
            f(s1)
        for _ in range(p - 1 - r):
            b(s1, True)
            w()
            f(s1)
        for _ in range(m - 2 * p + r + 1):
            f(s0)
            b(s1, False)
            f(s1)
            b(s0, False)
        for _ in range(p - 1 - r):
            b(s1, False)
            f(s1)
            b(s0, False)
        split, half = False, (r + 1) // 2
        for i in range(r + 1):
            split |= i == half and r % 2 == 1
            b(s1, split)
            split |= i == half and r % 2 == 0
            b(s0, split)
        for _ in range(p - 1 - r):
            w()
            b(s0, split)
        for _ in range(r + 1):
            w()
        if wq:  # the phase counts balance; a change to them that does not is a bug
            raise RuntimeError(f"dualpipe_v left {wq} unscheduled on rank {r}")
        out.append(tuple(seq))
    return Schedule("dualpipe-v", p, m, 2, "v", tuple(out), warmup=_warmup_of(out))


def _warmup_of(actions) -> tuple:
    """Forwards before the first backward, less the one that opens the steady state (all of
    them when a rank runs every forward first)."""
    out = []
    for acts in actions:
        n_f = sum(a.kind == "F" for a in acts)
        first = next((k for k, a in enumerate(acts) if a.kind != "F"), len(acts))
        out.append(first - 1 if first < n_f else first)
    return tuple(out)
