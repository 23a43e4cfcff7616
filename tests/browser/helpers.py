"""Playwright helpers for driving JupyterLab 4 notebooks in headless Chromium.

Needs a server started by the `jupyter_server` / `start_jupyter` fixtures (tests/conftest.py),
which pass ``--LabApp.expose_app_in_browser=True`` so that ``window.jupyterapp`` exists,
and switch autosave off so nothing is written back into notebooks/.

    open_notebook(page, server, "00_tour.ipynb")   # page load + kernel idle
    run_all(page)                                  # Run -> Run All Cells; raises on cell errors
    wait_idle(page)                                # kernel idle, no [*] prompts
    move_slider(page, "dp", +2)                    # keyboard on the noUiSlider handle -> readout
    plot_data(page)                                # [{type,name,x,y}, ...] of a .js-plotly-plot
    wait_plot_change(page, before)                 # poll until plot_data differs and settles
    titled_plot(page, "pipeline bubble")           # {data, annotations} of the plot so titled
    wait_titled_plot(page, "bubble", until)        # poll until until(titled_plot(...)) holds

All waits are explicit and bounded (``timeout`` in seconds, default 120).
"""
from __future__ import annotations

import re
import time

DEFAULT_TIMEOUT_S = 120.0

# True when the current main-area widget is a notebook whose kernel is connected and idle
# and no cell shows the running prompt [*].
_JS_IDLE = """() => {
  const app = window.jupyterapp;
  const w = app && app.shell.currentWidget;
  const sc = w && w.sessionContext;
  if (!sc || !sc.isReady || !sc.session || !sc.session.kernel) return false;
  if (sc.session.kernel.status !== 'idle') return false;
  if (!w.content || !w.content.widgets) return false;
  return !Array.from(document.querySelectorAll('.jp-InputPrompt'))
      .some(e => e.textContent.includes('*'));
}"""

_JS_NOTEBOOK_OPEN = """(name) => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  return !!(w && w.context && w.context.path === name && w.content
            && w.content.widgets && w.context.isReady);
}"""

_JS_CELL_ERRORS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const errs = [];
  w.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    for (const o of cell.model.outputs.toJSON())
      if (o.output_type === 'error') errs.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
  });
  return errs;
}"""

_JS_PLOT_DATA = """([sel, index]) => {
  const plots = document.querySelectorAll(sel);
  const gd = plots[index];
  if (!gd || !gd._fullData) return null;
  const arr = v => (v && ArrayBuffer.isView(v)) ? Array.from(v)
                   : Array.isArray(v) ? v.map(x => (x && ArrayBuffer.isView(x)) ? Array.from(x) : x)
                   : (v === undefined ? null : v);
  return gd._fullData.map(t => ({type: t.type, name: t.name ?? null, x: arr(t.x), y: arr(t.y)}));
}"""


# The plot whose title contains a text: found anew at each call, since a figure redrawn
# by a new output is a new element (an index into all plots would shift meanwhile).
_JS_TITLED_PLOT = """(needle) => {
  const gd = Array.from(document.querySelectorAll('.js-plotly-plot')).find(
      g => g._fullLayout && String((g._fullLayout.title || {}).text || '').includes(needle));
  if (!gd || !gd._fullData) return null;
  const arr = v => (v && ArrayBuffer.isView(v)) ? Array.from(v)
                   : Array.isArray(v) ? v.map(x => (x && ArrayBuffer.isView(x)) ? Array.from(x) : x)
                   : (v === undefined ? null : v);
  return {title: gd._fullLayout.title.text,
          data: gd._fullData.map(t => ({type: t.type, name: t.name ?? null,
                                        x: arr(t.x), y: arr(t.y)})),
          annotations: (gd._fullLayout.annotations || []).map(a => a.text)};
}"""


def _ms(timeout_s: float) -> float:
    return timeout_s * 1000.0


def _dismiss_dialogs(page) -> None:
    """Accept any modal dialog (e.g. 'Select Kernel' for a notebook without kernelspec)."""
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Enter")


def wait_idle(page, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until the current notebook's kernel is idle and no cell is queued/running.

    Accepts a kernel-selection dialog if one pops up meanwhile.
    """
    deadline = time.monotonic() + timeout
    while True:
        _dismiss_dialogs(page)
        if page.evaluate(_JS_IDLE):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"kernel not idle after {timeout:.0f}s")
        page.wait_for_timeout(200)


def open_notebook(page, server, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Open ``name`` (path relative to the server's root dir) in JupyterLab; wait for kernel idle."""
    url, token = server
    page.goto(f"{url}/lab/tree/{name}?token={token}", timeout=_ms(timeout))
    page.wait_for_function(_JS_NOTEBOOK_OPEN, arg=name, timeout=_ms(timeout), polling=200)
    wait_idle(page, timeout)


def cell_errors(page) -> list[str]:
    """``["cell 3: ValueError: ...", ...]`` for every error output in the current notebook."""
    return page.evaluate(_JS_CELL_ERRORS)


def run_all(page, timeout: float = DEFAULT_TIMEOUT_S, raise_on_error: bool = True) -> None:
    """Run all cells (the Run -> Run All Cells command) and wait until done and idle.

    ``commands.execute('notebook:run-all-cells')`` returns a promise that settles when every
    cell has finished; we start it without awaiting it inside page.evaluate (which has no
    timeout) and poll a flag instead.
    """
    wait_idle(page, timeout)
    page.evaluate("""() => {
      window.__labkitRunAll = 'running';
      window.jupyterapp.commands.execute('notebook:run-all-cells').then(
        r => { window.__labkitRunAll = 'done'; },
        e => { window.__labkitRunAll = 'error: ' + e; });
    }""")
    page.wait_for_function("() => window.__labkitRunAll !== 'running'",
                           timeout=_ms(timeout), polling=200)
    state = page.evaluate("() => window.__labkitRunAll")
    if state != "done":
        raise RuntimeError(f"notebook:run-all-cells failed: {state}")
    wait_idle(page, timeout)
    if raise_on_error:
        errors = cell_errors(page)
        if errors:
            raise AssertionError("notebook cells raised:\n" + "\n".join(errors))


def slider(page, description: str):
    """Locator of the ipywidgets slider whose description label is exactly ``description``."""
    label = page.locator(".widget-label", has_text=re.compile(rf"^\s*{re.escape(description)}\s*$"))
    return page.locator(".widget-slider").filter(has=label).first


def slider_value(page, description: str) -> str:
    """The slider's readout text (as displayed, e.g. '4' or '0.50')."""
    return slider(page, description).locator(".widget-readout").inner_text().strip()


def move_slider(page, description: str, steps: int, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Move a slider by ``steps`` slider steps (negative = left) with the keyboard.

    ipywidgets 8 sliders are noUiSlider: the ``.noUi-handle`` is focusable and each
    ArrowRight/ArrowLeft moves by one ``step`` and syncs the value to the kernel (for
    ``continuous_update=False`` sliders too, since keyboard moves fire 'change').
    Returns the new readout text; waits until it differs from the old one.
    """
    s = slider(page, description)
    s.wait_for(state="visible", timeout=_ms(timeout))
    before = slider_value(page, description)
    handle = s.locator(".noUi-handle").first
    handle.scroll_into_view_if_needed()
    handle.focus()
    key = "ArrowRight" if steps > 0 else "ArrowLeft"
    for _ in range(abs(steps)):
        handle.press(key)
    if steps:
        deadline = time.monotonic() + timeout
        while slider_value(page, description) == before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"slider {description!r} stayed at {before} after {steps} steps "
                                   "(at its limit?)")
            page.wait_for_timeout(100)
    return slider_value(page, description)


def wait_plot(page, index: int = 0, selector: str = ".js-plotly-plot",
              timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until the ``index``-th plotly plot has rendered data."""
    page.wait_for_function(
        "([sel, i]) => { const g = document.querySelectorAll(sel)[i];"
        " return !!(g && g._fullData && g._fullData.length); }",
        arg=[selector, index], timeout=_ms(timeout), polling=200)


def plot_data(page, index: int = 0, selector: str = ".js-plotly-plot"):
    """``[{type, name, x, y}, ...]`` of the index-th plotly plot (from ``gd._fullData``)."""
    return page.evaluate(_JS_PLOT_DATA, [selector, index])


def wait_plot_change(page, before, index: int = 0, selector: str = ".js-plotly-plot",
                     timeout: float = DEFAULT_TIMEOUT_S, until=None, settle: float = 0.5):
    """Poll until ``plot_data(page, index)`` differs from ``before``; returns the new data.

    A slider moved by several key presses updates the plot once per step, so by default
    we also wait until the data has stayed the same for ``settle`` seconds; pass
    ``until=lambda data: ...`` to wait for a specific state instead.
    """
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        now = plot_data(page, index, selector)
        if now != last:
            last, since = now, time.monotonic()
        if now is not None and now != before:
            if until is not None:
                if until(now):
                    return now
            elif time.monotonic() - since >= settle:
                return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"plot {index} did not reach the expected change within "
                               f"{timeout:.0f}s (now {now})")
        page.wait_for_timeout(100)


def titled_plot(page, needle: str):
    """``{title, data: [{type, name, x, y}, ...], annotations: [text, ...]}`` of the plotly
    plot whose title contains ``needle`` (from ``gd._fullData`` / ``_fullLayout``), or
    ``None`` while there is none."""
    return page.evaluate(_JS_TITLED_PLOT, needle)


def wait_titled_plot(page, needle: str, until, timeout: float = DEFAULT_TIMEOUT_S):
    """Poll :func:`titled_plot` until ``until(plot)`` holds; returns that plot.

    Raises:
        TimeoutError: naming what the plot held last.
    """
    deadline = time.monotonic() + timeout
    while True:
        now = titled_plot(page, needle)
        if now is not None and until(now):
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"plot {needle!r} did not reach the expected state within "
                               f"{timeout:.0f}s (now {now})")
        page.wait_for_timeout(100)
