"""Redraw a displayed plotly figure in place, with ``Plotly.react`` on the plot already drawn.

Why: a :class:`~labkit_widgets._static.LiveFigure` shows its figure as an output of an
``ipywidgets.Output``, and a new figure there replaces the output. In JupyterLab that
disposes the plot, builds a new renderer and plot, and (plotly's JupyterLab renderer, 7.x)
renders a PNG snapshot of every new plot: on the lab machine a slider move that redraws
four figures spent about 0.3 s in the page that way, and 0.1 s of it on the snapshots.
``Plotly.react`` on the plot already drawn changes only what changed.

How: :class:`InPlace` is a small ``anywidget`` shown as a second, invisible output of the
same ``Output``. Its front end takes plotly.js from plotly's own JupyterLab extension (the
library that drew the first output; it is not a global, so it is read through the
extension's module-federation container, ``window._JUPYTERLAB["jupyterlab-plotly"]``), finds
the plot beside it, and says ``ready``. From then on the figure travels in ``figure`` and
is drawn with ``Plotly.react``; every redraw is acknowledged (``drawn``).

Fallback: wherever that cannot work (no JupyterLab, a plotly extension without that
module, anywidget's 2-second start-up deadline missed on a busy page, a draw that failed or
was not acknowledged within :data:`ACK_TIMEOUT_S`), the front end never says ``ready`` or
says ``failed``, and :meth:`InPlace.can_draw` is false: the figure goes the replacing way,
as before. A view opened later (a second display, a reloaded page) draws the latest
``figure`` as soon as it is ready.
"""
from __future__ import annotations

import time

import anywidget
import traitlets

__all__ = ["InPlace", "ACK_TIMEOUT_S"]

#: a redraw not acknowledged by the front end within this many seconds turns in-place off
ACK_TIMEOUT_S = 3.0

_ESM = r"""
let api = null;
async function plotly() {
  if (api) return api;
  const c = globalThis._JUPYTERLAB && globalThis._JUPYTERLAB["jupyterlab-plotly"];
  if (!c) return null;
  const mod = (await c.get("./mimeExtension"))();
  const R = mod && mod.RenderedPlotly;
  if (!R) return null;
  if (!R.Plotly && R.loadingPlotly) await R.loadingPlotly;
  api = R.Plotly && typeof R.Plotly.react === "function" ? R.Plotly : null;
  return api;
}

function plotBeside(el) {
  const area = el.closest(".jp-OutputArea");
  return area ? area.querySelector(".js-plotly-plot") : null;
}

async function waitForPlot(el, ms) {
  const end = performance.now() + ms;
  while (performance.now() < end) {
    const gd = plotBeside(el);
    if (gd && gd._fullLayout) return gd;
    await new Promise(r => setTimeout(r, 50));
  }
  return null;
}

const sleep = ms => new Promise(r => setTimeout(r, ms));

function render({ model, el }) {
  el.style.display = "none";
  let chain = Promise.resolve();
  let live = false, gone = false;
  // the page may build a view before it attaches it (a reloaded notebook restores its
  // outputs off-document): wait for that, never drop the draw
  const attached = async () => {
    for (let i = 0; !el.isConnected; i++) {
      if (gone || i > 2400) return false;  // a view that left the page: the others draw
      await sleep(250);
    }
    return true;
  };
  const draw = (fixes = 0) => {
    chain = chain.then(async () => {
      if (!(await attached())) return;
      const seq = model.get("seq"), fig = model.get("figure");  // the latest, read now
      if (seq <= 0) return;
      const P = await plotly();
      const gd = plotBeside(el);
      if (!P || !gd || !fig || !fig.data) throw new Error("no plot to redraw");
      await P.react(gd, fig.data, fig.layout || {}, fig.config || {});
      model.send({ event: "drawn", seq });
      // plotly's own first render of this output can finish after a catch-up draw and
      // put its (older) figure back: look again, and draw the latest once more if so
      if (fixes < 2)
        for (const ms of [300, 1500, 5000])
          setTimeout(() => {
            const now = plotBeside(el);
            if (!gone && model.get("seq") === seq && now && now.data !== fig.data)
              draw(fixes + 1);
          }, ms);
    }).catch(e => model.send({ event: "failed", seq: model.get("seq"), error: String(e) }));
    return chain;
  };
  const onSeq = () => { if (live && model.get("seq") > 0) draw(); };
  model.on("change:seq", onSeq);
  (async () => {
    try {
      const P = await plotly();
      const gd = P && (await attached()) && await waitForPlot(el, 20000);
      if (!gd) return;  // never ready: the kernel keeps replacing the output
      live = true;
      if (model.get("seq") > 0) await draw();  // a later view: catch up
      model.send({ event: "ready", gen: model.get("gen") });
    } catch (e) {
      model.send({ event: "failed", seq: model.get("seq"), error: String(e) });
    }
  })();
  return () => { gone = true; model.off("change:seq", onSeq); };
}

export default { render };
"""


class InPlace(anywidget.AnyWidget):
    """The in-place channel of one figure (see the module docstring).

    Traits (synced): ``figure`` — the plotly JSON (``{"data", "layout", "config"}``) drawn
    in place, ``seq`` — its number (0: nothing to draw in place), ``gen`` — the generation
    of the output it sits beside (raised whenever that output is replaced).
    """

    _esm = _ESM
    figure = traitlets.Dict().tag(sync=True)
    seq = traitlets.Int(0).tag(sync=True)
    gen = traitlets.Int(0).tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._ready_gen = -1          # generation whose view said "ready"
        self._unacked: dict = {}      # seq -> monotonic time sent
        self.errors: list = []        # front-end failures, newest last (at most 10)
        self.on_msg(self._on_front)

    def _on_front(self, _widget, content, _buffers) -> None:
        event = content.get("event") if isinstance(content, dict) else None
        if event == "ready" and content.get("gen") == self.gen:
            self._ready_gen = self.gen
        elif event == "drawn":
            for s in [s for s in self._unacked if s <= content.get("seq", 0)]:
                del self._unacked[s]
        elif event == "failed":
            self._ready_gen = -1
            self.errors = (self.errors + [str(content.get("error", ""))])[-10:]

    def can_draw(self) -> bool:
        """Whether the next figure can go in place: a view of the current output said
        ``ready``, none failed since, and no redraw is older than :data:`ACK_TIMEOUT_S`
        unacknowledged."""
        if self._ready_gen != self.gen:
            return False
        now = time.monotonic()
        if any(now - t > ACK_TIMEOUT_S for t in self._unacked.values()):
            self._ready_gen = -1
            return False
        return True

    def draw(self, plotly_json: dict) -> None:
        """Send ``plotly_json`` to be drawn in place (call only when :meth:`can_draw`)."""
        seq = self.seq + 1
        self._unacked[seq] = time.monotonic()
        with self.hold_sync():
            self.figure = plotly_json
            self.seq = seq

    def replaced(self) -> None:
        """The output beside it is being replaced: forget the in-place state (its views
        go with the output; the new view says ``ready`` again)."""
        self._ready_gen, self._unacked = -1, {}
        with self.hold_sync():
            self.figure, self.seq, self.gen = {}, 0, self.gen + 1

    def view_output(self) -> dict:
        """The output (nbformat ``display_data``) that shows this widget. It names the
        generation: an output replaced by the same figure it held before (drawn over in
        place since) is still a new value, so it is sent and drawn again."""
        return {"output_type": "display_data", "metadata": {"labkit_gen": self.gen},
                "data": {"application/vnd.jupyter.widget-view+json": {
                    "model_id": self.model_id, "version_major": 2, "version_minor": 0},
                    "text/plain": ""}}
