"""The Explorer's figures and notes as a learner reads them (issue 25), headless, on the
widget state: the bytes chart has no legend to cover its rank labels; the timeline draws
point-to-point calls on their own lane, so a send that spans the step cannot hide the
collectives it overlaps, and every communication bar's hover names op, group, bytes and
time; the "unavailable now" note lists every reason with no scroll area; a model control
re-runs on the cluster, with ep offered only for a mixture-of-experts model."""
from __future__ import annotations

import html
import re

import pytest

from labkit.config import RunConfig
from labkit.trace import Event, Trace

from test_widgets import FakeCluster, _explorer, _plain


def _comm_metrics():
    """Two ranks whose bytes split into four (axis, collective) bars each: SP and ep."""
    by = {"tp": {"all_gather": 3e5, "reduce_scatter": 3e5}, "dp": {"all_reduce": 8e5},
          "ep": {"all_to_all": 2e5}}
    return [{"rank": r, "n_params": 1000, "comm_bytes_by_axis": by,
             "comm_predicted_by_axis": by} for r in range(2)]


def test_the_bytes_chart_has_no_legend_over_its_rank_labels():
    from labkit_widgets import explorer_figures as F

    fig = F.comm_figure()
    F.draw_comm(fig, _comm_metrics(), RunConfig(model="tiny-moe").replace(
        dp=2, tp=2, ep=2))
    assert len(fig.data[0].x[0]) == 8 and set(fig.data[0].x[0]) == {"rank 0", "rank 1"}
    # a legend anywhere below the plot met the two-row axis labels; the title names both
    assert fig.layout.showlegend is False
    title = fig.layout.title.text
    assert "measured" in title and "formula hatched" in title
    assert fig.data[1].marker.pattern.shape == "/"  # the formula is the hatched bar


def _pipeline_trace():
    """Rank 0 sends one activation asynchronously: issued at 0 ms, complete at 100 ms,
    while twenty tensor-parallel all-gathers run; rank 1 receives it at 100 ms."""
    ev = [Event(0, "forward", "compute", 0.0, 0.09, 1),
          Event(0, "send", "p2p", 0.0, 0.1, 1, "send", 4096.0, 0.0, "pp", (1,)),
          Event(1, "recv", "p2p", 0.0, 0.1, 1, "recv", 0.0, 4096.0, "pp", (0,)),
          Event(1, "forward", "compute", 0.1, 0.19, 1)]
    ev += [Event(0, "all_gather", "comm", 0.004 * i, 0.004 * i + 0.002, 1, "all_gather",
                 1024.0, 1024.0, "tp", (0, 2)) for i in range(20)]
    return Trace(ev)


def test_point_to_point_calls_get_their_own_lane_and_every_bar_says_what_it_is():
    from labkit_widgets.timeline import (_FAMILIES, COMM_OFFSET, P2P_OFFSET, P2P_PITCH,
                                         TimelineView, timeline_traces)

    cols, layout = timeline_traces(_pipeline_trace(), step=1)
    by = {fam: c for (_k, fam), c in zip(_FAMILIES, cols) if _k == "comm"}
    p2p, ag = by["p2p"], by["all_gather"]
    assert len(ag["x"]) == 20 and len(p2p["x"]) == 2
    # no p2p bar on a lane that holds a collective: the 100 ms send covers nothing
    assert not set(p2p["y"]) & set(ag["y"])
    assert sorted(set(p2p["y"])) == pytest.approx([P2P_OFFSET, P2P_PITCH + P2P_OFFSET])
    assert set(ag["y"]) == {COMM_OFFSET}
    assert layout["yaxis.ticktext"] == ["rank 0", "comm", "p2p", "rank 1", "comm", "p2p"]
    # hover: op, axis, group or peer, bytes and ms on every bar
    for c in (p2p, ag):
        for cd in c["customdata"]:
            assert cd[2] in ("send", "recv", "all_gather") and cd[8] in ("pp", "tp")
            assert re.fullmatch(r"group \[0, 2\]|to rank 1|from rank 0", cd[9]), cd
            assert cd[3] != "" and cd[5] > 0
    tv = TimelineView(_pipeline_trace())
    tmpl = {t.name: t.hovertemplate for t in tv.fig.data}
    for key in ("op %{customdata[2]}", "%{customdata[9]}", "sent %{customdata[3]}",
                "%{customdata[5]:.3f} ms"):
        assert key in tmpl["p2p"] and key in tmpl["all-gather"], key
    # a run without send/recv keeps one row per rank and the lane the notebooks read
    plain = Trace([e for e in _pipeline_trace().events if e.cat != "p2p"])
    cols, layout = timeline_traces(plain, step=1)
    assert "p2p" not in layout["yaxis.ticktext"]
    assert set(dict(zip([f for _k, f in _FAMILIES], cols))["all_gather"]["y"]) == {COMM_OFFSET}


def test_every_unavailable_reason_is_in_the_page_with_no_scroll_area():
    from labkit_widgets import explorer_controls as C

    ex = _explorer(FakeCluster(world_size=4), RunConfig(global_batch=8).replace(dp=4))
    note = ex.unavailable.value
    assert "max-height" not in note and "overflow" not in note
    avail = C.availability(ex.base, ex.values, 4)
    refused = {(n, C.label(v)) for n, a in avail.items() if a["applies"]
               for v in a["refused"]}
    greyed = [n for n, a in avail.items() if not a["applies"]]
    items = re.findall(r"<li>(.*?)</li>", note)
    listed = {(m.group(1), v) for it in items
              for m in [re.match(r"<b>(\w+)=([^<]*)</b>", it)] if m
              for v in m.group(2).split(", ")}
    assert listed == refused and len(refused) > C.OPEN_LINES
    assert sum("greyed" in it for it in items) == len(greyed)
    for a in avail.values():
        for why in a["refused"].values():
            assert html.escape(why.split(": ", 1)[-1]) in note or html.escape(why) in note
    # a long list folds under a summary that counts it; a short one stays open
    summary = _plain(re.search(r"<summary>(.*?)</summary>", note).group(1))
    assert "<details open" not in note
    assert summary.startswith(f"unavailable now: {len(refused)} values of ")
    assert f"{len(greyed)} knobs greyed" in summary and "click" in summary
    short = C.unavailable_html({n: {**a, "refused": dict(list(a["refused"].items())[:1])}
                                if n == "dp" else {**a, "refused": {}, "applies": True}
                                for n, a in avail.items()}, ex.config(), 4)
    assert "<details open" in short and short.count("<li>") == 1


def test_the_model_control_reruns_and_offers_ep_only_for_experts():
    from labkit_widgets import explorer_controls as C

    fake = FakeCluster(world_size=4)
    ex = _explorer(fake, RunConfig(global_batch=8).replace(dp=4))
    model, ep = ex.controls["model"], ex.controls["ep"]
    assert [v for _, v in model.options][:2] == ["tiny", "tiny-moe"] and not model.disabled
    assert set(C.RUN_MODELS) <= {v for _, v in model.options} | set(
        C.availability(ex.base, ex.values, 4)["model"]["refused"])
    assert [v for _, v in ep.options] == [1] and ep.disabled
    assert "ep=2, 4" in ex.unavailable.value or "ep=2" in ex.unavailable.value
    assert "mixture-of-experts" in _plain(ex.unavailable.value)
    model.value = "tiny-moe"  # the path a released dropdown takes: a real re-run
    assert fake.configs[-1].model == "tiny-moe" and ex.last_error is None
    assert [v for _, v in ep.options] == [1, 2, 4] and not ep.disabled
    assert ex.set(ep=2) is not None and fake.configs[-1].parallel.ep == 2
    # back to the dense model while ep=2: refused in validate's words, nothing changes
    assert ex.set(model="tiny") is None and "mixture-of-experts" in _plain(ex.status.value)
    assert model.value == "tiny-moe"
    assert "model=tiny" in _plain(ex.unavailable.value)
    ex.set(ep=1)
    # the ViT reads digits; with pp > 1 it is refused, saying why
    assert ex.set(model="vit-digits") is not None
    assert fake.configs[-1].dataset == "digits" and fake.configs[-1].model == "vit-digits"
    assert ex.set(model="tiny") is not None and fake.configs[-1].dataset == "text"
    ex.set(dp=2, pp=2)
    assert "vit-digits" in _plain(ex.unavailable.value)
    assert "pipeline and expert parallelism are not built" in _plain(ex.unavailable.value)
