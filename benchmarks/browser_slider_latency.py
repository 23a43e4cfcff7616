"""Pointer release → last figure redrawn, for the explorer in JupyterLab in Chromium.

The browser's side of ``benchmarks/slider_latency.py`` (which times the kernel alone):
JupyterLab (the test harness's server, tests/conftest.py) opens a notebook with the tour's
explorer on a 4-rank cluster in headless Chromium at 1280 px; the mouse drags the dp or pp
slider's handle one option along and lets go. A move's latency runs from the pointer
release (``pointerup``, page clock) to the last change of any of the explorer's plots (a
new plot element or new drawn data, polled in the page every 10 ms); the move is over
when the history table has its row and the plots have not changed for 2 s. Also printed:
the kernel's own latency for the move (the status line: change → figures sent).

Six moves (dp 4 → 2 → 1, pp 1 → 2 → 1, dp 1 → 2 → 4) make a pass; a warm-up pass first
(each shape's first run counts FLOPs), then ``--passes`` timed passes (default 2: a dozen
moves; the first pass of a configuration tracks memory, later ones reuse it).

Goal (slider → figure): p90 ≤ 0.5 s. The numbers depend on the machine's load: the script
prints the load average before and after. Needs /usr/bin/chromium (or $LABKIT_CHROMIUM).

    .venv/bin/python benchmarks/browser_slider_latency.py [--passes 2] [--warmup 1]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

#: one pass of slider moves: (slider label, options to move by)
MOVES = (("dp", -1), ("dp", -1), ("pp", +1), ("pp", -1), ("dp", +1), ("dp", +1))
WIDTH = 1280

CELLS = ['''\
import torch
import labkit as lk
from labkit_widgets import Explorer

torch.set_num_threads(1)
cluster = lk.Cluster(world_size=4)''', '''\
explorer = Explorer(cluster, lk.RunConfig(model="tiny", steps=3, global_batch=8).replace(dp=4))
explorer''']

# In the page: the time of the last pointer release, and of the last change of the
# explorer's plots (an element or its drawn data not seen at the previous poll).
_JS_WATCH = """() => {
  if (window.__labkitWatch) return;
  window.__labkitWatch = true;
  window.addEventListener('pointerup', () => { window.__labkitRelease = performance.now(); },
                          true);
  const ids = new WeakMap(); let next = 1, last = '';
  const id = o => { if (!o) return 0; if (!ids.has(o)) ids.set(o, next++); return ids.get(o); };
  setInterval(() => {
    const out = Array.from(document.querySelectorAll('.jp-OutputArea-output'))
        .find(o => o.querySelector('.labkit-history') && !o.parentElement.closest('.jp-OutputArea-output'));
    if (!out) return;
    const sig = Array.from(out.querySelectorAll('.js-plotly-plot'))
        .map(g => id(g) + ':' + id(g._fullData)).join(',');
    if (sig !== last) { last = sig; window.__labkitPlotChange = performance.now(); }
  }, 10);
}"""
_JS_RUNS = "() => document.querySelectorAll('table.labkit-history tbody tr[title]').length"
_JS_STATE = "() => [window.__labkitRelease || null, window.__labkitPlotChange || null, performance.now()]"


def _slider(page, label: str):
    from browser.helpers import slider

    return slider(page, label)


def _drag(page, label: str, by: int) -> None:
    """Drag the handle of the slider ``label`` ``by`` options along and let go."""
    s = _slider(page, label)
    s.scroll_into_view_if_needed()
    target = s.locator(".noUi-target").first
    idx, n = target.evaluate("t => [Math.round(Number(t.noUiSlider.get())), "
                             "t.noUiSlider.options.range.max]")
    to = idx + by
    if not 0 <= to <= n:
        raise SystemExit(f"slider {label!r} at option {idx} of 0..{n} cannot move by {by}")
    base = s.locator(".noUi-base").first.bounding_box()
    handle = s.locator(".noUi-handle").first.bounding_box()
    x0, y = handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2
    x1 = base["x"] + base["width"] * to / n
    page.mouse.move(x0, y)
    page.mouse.down()
    page.mouse.move(x1, y, steps=8)
    page.mouse.up()


def _status(page) -> str:
    return page.locator(".labkit-status").first.inner_text()


def _move(page, label: str, by: int, settle_s: float = 2.0, timeout_s: float = 300.0) -> dict:
    """One released drag; the release → last plot change latency and the kernel's own."""
    from browser.helpers import slider_value, wait_idle

    runs, before = page.evaluate(_JS_RUNS), slider_value(page, label)
    page.evaluate("() => { window.__labkitRelease = null; }")
    _drag(page, label, by)
    page.wait_for_function(f"() => ({_JS_RUNS})() > {runs}", timeout=timeout_s * 1000,
                           polling=50)
    while True:  # the plots keep still for settle_s
        release, change, now = page.evaluate(_JS_STATE)
        if change is not None and release is not None and change > release \
                and now - change >= settle_s * 1000:
            break
        page.wait_for_timeout(100)
    wait_idle(page, timeout_s)
    status = _status(page)
    m = re.search(r"figures sent ([0-9.]+) s after the change", status)
    return {"move": f"{label} {before}→{slider_value(page, label)}",
            "browser_s": (change - release) / 1e3,
            "kernel_s": float(m.group(1)) if m else float("nan")}


def _pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(passes: int = 2, warmup: int = 1) -> dict:
    import nbformat
    from playwright.sync_api import sync_playwright

    import conftest as harness
    from browser.helpers import open_notebook, run_all

    load0 = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="labkit-bench-"))
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nbformat.write(nb, root / "bench.ipynb")
    server = harness._launch_jupyter(root, root / "state", root / "logs")
    rows = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=harness.CHROMIUM, headless=True,
                                        args=harness.CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": WIDTH, "height": 900}).new_page()
            open_notebook(page, server, "bench.ipynb", timeout=300)
            run_all(page, timeout=600)
            page.evaluate(_JS_WATCH)
            for p_ in range(warmup + passes):
                for label, by in MOVES:
                    row = _move(page, label, by)
                    row["pass"] = p_ + 1 - warmup
                    if row["pass"] > 0:
                        rows.append(row)
                    print(f"{'warm-up' if row['pass'] <= 0 else 'pass ' + str(row['pass']):>7}"
                          f" {row['move']:<10} browser {row['browser_s']:6.3f} s,"
                          f" kernel {row['kernel_s']:6.3f} s", flush=True)
            browser.close()
    finally:
        server.stop()
    load1 = os.getloadavg()
    out = {}
    for label, sel in [("", rows)] + [(f"_pass{k}", [r for r in rows if r["pass"] == k])
                                      for k in range(1, passes + 1)]:
        for side in ("browser", "kernel"):
            lat = [r[f"{side}_s"] for r in sel]
            out[side + label] = (statistics.median(lat), _pct(lat, 0.9))
            print(f"RESULT {side}_slider_latency{label}_p50_s {out[side + label][0]:.3f}")
            print(f"RESULT {side}_slider_latency{label}_p90_s {out[side + label][1]:.3f}")
    print(f"{len(rows)} moves; load average (1 min) before {load0[0]:.1f}, after "
          f"{load1[0]:.1f} on {os.cpu_count()} cores")
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    main(a.passes, a.warmup)
