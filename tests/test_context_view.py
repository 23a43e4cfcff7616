"""ContextParallelView, headless: every step drawn from the ranks' recorded events — the K/V
rotation of the ring, the mask blocks and work per rank, Ulysses' sequence↔head reshuffle,
all-gather's gather and reduce-scatter."""
from __future__ import annotations

import json

import pytest

from labkit.parallel.context import chunk_ids

pytestmark = pytest.mark.distributed


@pytest.fixture
def ring(cluster4):
    from labkit_widgets.context_view import ContextParallelView

    return ContextParallelView(cluster4, method="ring", cp=4, zigzag=True)


def _holders(view):
    return [list(row) for row in view.fig.data[0].z]


def _mask(view):
    return [list(row) for row in view.fig.data[1].z], [list(r) for r in view.fig.data[1].text]


def test_ring_steps_show_the_kv_blocks_rotating(ring):
    cp, chunks = 4, [chunk_ids(r, 4, True) for r in range(4)]
    assert [f["event"] for f in ring.frames] == ["layout"] + ["compute"] * cp
    assert ring.step.max == cp and ring.step.value == 0
    assert _holders(ring) == [[r if c in chunks[r] else None for c in range(8)]
                              for r in range(cp)]
    for s in range(1, cp + 1):
        ring.step.value = s
        origin = [(r - (s - 1)) % cp for r in range(cp)]  # ring step s−1: K/V of rank r−s+1
        assert _holders(ring) == [[origin[r] if c in chunks[origin[r]] else None
                                   for c in range(8)] for r in range(cp)]
        assert f"ring step {s - 1}" in ring.fig.layout.title.text
    assert "no messages" in ring.info.value  # the last step sends nothing: cp−1 hops
    ring.step.value = 1
    assert ring.info.value.count("global rank") == cp and "kv" in ring.info.value


def test_ring_mask_and_work_end_at_the_closed_form(ring):
    ring.play.value = ring.step.max  # the Play widget drives the step slider
    z, text = _mask(ring)
    owner = {c: r for r in range(4) for c in chunk_ids(r, 4, True)}
    for q in range(8):
        for k in range(8):
            want = "F" if q > k else "D" if q == k else "×"
            assert text[q][k] == want
            assert z[q][k] == (owner[q] if q >= k else None)
    work = list(ring.fig.data[2].y)
    assert work == list(ring.fig.data[3].y) == ring.report["work_formula"]
    assert len(set(work)) == 1 and "imbalance 1.000" in ring.status.value
    ring.step.value = 1
    assert sum(ring.fig.data[2].y) < sum(work)  # the work accumulates step by step
    ring.phase.value = "backward"
    assert len(ring.frames) == 5 and ring.step.value == 0
    ring.step.value = 4
    assert list(ring.fig.data[2].y) == work  # the backward visits the same blocks


def test_contiguous_split_loads_the_last_rank(ring):
    ring.set(zigzag=False, step=4)
    work = list(ring.fig.data[2].y)
    assert work == sorted(work) and work[0] < work[-1]
    assert work == ring.report["work_formula"] and "contiguous" in ring.status.value
    assert ring.report["imbalance"] > 1.5


def test_ulysses_reshuffles_sequence_and_heads(ring):
    ring.set(method="ulysses", cp=2)
    f = ring.frames
    assert [x["event"] for x in f] == ["layout", "all_to_all", "all_to_all", "compute",
                                      "all_to_all"]
    owner = {c: r for r in range(2) for c in chunk_ids(r, 2, True)}
    seq = [[owner[c] for c in range(4)] for _g in range(2)]   # vertical stripes
    heads = [[g] * 4 for g in range(2)]                       # horizontal stripes
    expected = [seq, heads, heads, heads, seq]
    for i, want in enumerate(expected):
        ring.step.value = i
        assert _holders(ring) == want, i
    z, _ = _mask(ring)
    assert z[3][0] == 2  # every rank computes every block, for its own heads
    assert "heads-sharded" in f[1]["label"] and "sequence-sharded" in f[4]["label"]


def test_allgather_gathers_then_reduce_scatters(ring):
    ring.set(method="allgather", cp=2, causal=False)
    assert [x["event"] for x in ring.frames] == ["layout", "all_gather", "compute"]
    ring.step.value = 1
    assert all(v is not None for row in _holders(ring) for v in row)
    ring.phase.value = "backward"
    assert [x["event"] for x in ring.frames] == ["layout", "compute", "reduce_scatter"]
    ring.step.value = 2
    chunks = [chunk_ids(r, 2, True) for r in range(2)]
    assert _holders(ring) == [[r if c in chunks[r] else None for c in range(4)]
                              for r in range(2)]
    _z, text = _mask(ring)
    assert {t for row in text for t in row} == {"F"}  # no mask: every block full
    assert "reduce_scatter sent" in ring.info.value


def test_static_snapshot_and_no_cluster(ring):
    from labkit_widgets.context_view import ContextParallelView

    snap = ring.figure(step=2)
    json.loads(snap.to_json())
    assert "step 2/4" in snap.layout.title.text
    assert "application/vnd.plotly.v1+json" in ring._repr_mimebundle_()
    v = ContextParallelView(None)
    assert v.result is None and "ContextParallelView(no run" in repr(v)
    v.rerun()
    assert "no cluster" in v.status.value
    v.update(ring.result)
    assert v.step.max == len(v.frames) - 1 and v.fig.data[0].z is not None


def test_a_trace_with_a_missing_step_is_refused(ring):
    import dataclasses

    from labkit.trace import Trace
    from labkit_widgets.context_frames import context_frames

    events = list(ring.result.trace.events)
    drop = next(e for e in events if e.rank == 2 and e.name == "cp.ring.forward")
    broken = dataclasses.replace(ring.result, trace=Trace(e for e in events if e is not drop))
    with pytest.raises(ValueError, match="different numbers of forward steps"):
        context_frames(broken)
    assert len(context_frames(broken, "backward")) == 5


def test_the_problem_stays_fixed_as_cp_moves(ring, cluster4):
    """Moving cp splits the same sequence: S and the heads stay, and the title says them;
    bytes per rank follow context parallelism at a fixed S (the ring's grow toward 3× the
    whole K/V, Ulysses' fall as 1/cp), work per rank halves, and a re-run at the shown
    settings reproduces the shown numbers."""
    from labkit_widgets.context_view import ContextParallelView

    S = ring.shape["seq_len"]
    assert f"S = {S}" in ring.fig.layout.title.text and f"S = {S}" in ring.status.value
    assert list(ring.cp.options) == [1, 2, 4]
    first = ring.report["bytes"]
    sent = lambda v: [b["forward"] + b["backward"] for b in v.report["bytes"]]  # noqa: E731
    four = sent(ring)
    ring.set(cp=2)
    case = ring.result.config
    assert (case.seq_len, case.n_heads, case.n_kv_heads) == (S, 4, 4)
    two = sent(ring)
    # ring: (3cp − 2) K/V blocks of 2·B·K·(S/cp)·D·4 bytes → cp=4 sends 10/8 of cp=2's
    assert [4 * b for b in four] == [5 * b for b in two[:1] * 4]
    work2 = ring.report["work"]
    ring.set(cp=4)
    assert ring.report["bytes"] == first                    # the same settings, the same numbers
    assert sum(ring.report["work"]) == sum(work2)           # the same problem, split further
    assert [2 * w for w in ring.report["work"]] == work2[:1] * 4
    ring.set(method="ulysses", cp=2)
    u2 = sent(ring)
    ring.set(cp=4)
    assert sent(ring)[0] < u2[0]                            # Ulysses: (cp−1)/cp² of the tensors
    shown = ContextParallelView(cluster4, run=False).update(ring.result)
    assert shown.cp.value == 4 and shown.method.value == "ulysses"
    before = shown.report["bytes"]
    shown.set(method="ring")
    shown.set(method="ulysses")
    assert shown.report["bytes"] == before
    ring.set(method="ring", cp=1)  # one rank: nothing is sent, so nothing is "hidden"
    assert "no communication" in ring.status.value
    assert "hidden under compute" not in ring.status.value
    with pytest.raises(ValueError, match="cp=3 does not split S=512"):
        ContextParallelView(None, cp=3)
