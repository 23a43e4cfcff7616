"""Layout checks of a notebook's outputs as JupyterLab rendered them.

``layout_problems(page)`` returns one dict per problem found in the current notebook's
outputs: ``{"cell", "output", "kind", "detail", "explorer"}`` where kind is

* ``"wider"`` — the output scrolls sideways, or an element in it ends right of the output;
* ``"truncated label"`` — a control's label, readout, button or selected option is cut
  (``scrollWidth > clientWidth``, or the option text wider than its ``<select>``);
* ``"null tooltip"`` — a visible element carries ``title="null"`` (a "null" tooltip on
  hover);
* ``"short slider"`` — a slider whose track is under 60 px (too short to drag by hand);
* ``"wrapped line"`` — a printed line broke onto a second line (JupyterLab wraps long
  stream lines anywhere, mid-word too);
* ``"clipped text"`` — a plotly text element (tick label, title, legend entry) extends past
  its figure;
* ``"legend scrolls"`` — a plotly legend taller than its figure, shown with a scrollbar;
* ``"empty figure"`` — a plotly figure that drew no traces.

``explorer`` is true for outputs that hold the explorer (its history table), so a test can
report those separately. ``open_sidebar(page)`` opens the file browser, as a new user
has it, which leaves the notebook about 830 px of output width in a 1280 px window.
Outputs inside a widget (a figure's own output area) count as part of the cell's output.
"""
from __future__ import annotations

_JS_PROBLEMS = r"""() => {
  const out = [];
  const name = el => el.tagName.toLowerCase() + (el.className && el.className.baseVal === undefined
      ? '.' + String(el.className).trim().split(/\s+/).slice(0, 2).join('.') : '');
  const canvas = document.createElement('canvas').getContext('2d');
  const cells = Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell'));
  cells.forEach((cell, ci) => {
    const kids = cell.querySelectorAll('.jp-OutputArea-child');
    kids.forEach((child, oi) => {
      // a cell's own outputs; an output inside a widget (a figure's) belongs to those
      if (child.parentElement.closest('.jp-OutputArea-child')) return;
      const o = child.querySelector('.jp-OutputArea-output');
      if (!o) return;
      const box = o.getBoundingClientRect();
      if (box.width === 0) return;
      const explorer = !!o.querySelector('.labkit-history');
      const add = (kind, detail) => out.push({cell: ci, output: oi, kind, detail, explorer});
      if (o.scrollWidth > o.clientWidth + 1)
        add('wider', `output scrolls: ${o.scrollWidth} px of content in ${o.clientWidth} px`);
      for (const el of o.querySelectorAll('*')) {
        const r = el.getBoundingClientRect();
        if (r.width === 0 || r.height === 0) continue;
        if (el.closest('.js-plotly-plot') && !el.classList.contains('js-plotly-plot')
            && !el.classList.contains('main-svg')) continue;  // plotly: checked below
        if (r.right > box.right + 1.5) {
          add('wider', `${name(el)} ends at ${Math.round(r.right)} px, output at ${Math.round(box.right)} px`);
          break;
        }
      }
      const labels = o.querySelectorAll('.widget-label, .widget-label-basic, .widget-readout, '
                                        + 'button, .widget-checkbox label, .widget-html-content');
      for (const el of labels) {
        if (el.classList.contains('widget-html-content')) continue;
        const text = (el.textContent || '').trim();
        if (text && el.scrollWidth > el.clientWidth + 1)
          add('truncated label', `"${text}" needs ${el.scrollWidth} px, has ${el.clientWidth} px`);
      }
      for (const sel of o.querySelectorAll('select')) {
        const opt = sel.options[sel.selectedIndex];
        if (!opt) continue;
        const cs = getComputedStyle(sel);
        canvas.font = `${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
        const need = canvas.measureText(opt.text).width + parseFloat(cs.paddingLeft)
                     + parseFloat(cs.paddingRight);
        if (need > sel.clientWidth + 1)
          add('truncated label', `option "${opt.text}" needs ${Math.round(need)} px, has ${sel.clientWidth} px`);
      }
      for (const track of o.querySelectorAll('.widget-slider .noUi-target')) {
        const r = track.getBoundingClientRect();  // a slider too short to drag by hand
        if (r.width > 0 && r.width < 60)
          add('short slider', `a slider track of ${Math.round(r.width)} px`);
      }
      for (const el of o.querySelectorAll('[title="null"]')) {
        const r = el.getBoundingClientRect();  // an empty, collapsed label cannot be hovered
        if (r.width > 0 && r.height > 0)
          add('null tooltip', `${name(el)} "${(el.textContent || '').trim().slice(0, 40)}"`);
      }
      for (const pre of o.querySelectorAll('pre')) {
        const lines = pre.textContent.replace(/\n$/, '').split('\n');
        const lh = parseFloat(getComputedStyle(pre).lineHeight);
        if (!lh) continue;
        const rows = Math.round(pre.getBoundingClientRect().height / lh);
        if (rows > lines.length) {
          const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
          add('wrapped line', `${rows} rows for ${lines.length} lines; longest (${longest.length} chars): ${longest.slice(0, 60)}…`);
        }
      }
      for (const gd of o.querySelectorAll('.js-plotly-plot')) {
        if (!(gd._fullData && gd._fullData.length)) add('empty figure', 'a figure drew no traces');
        const svg = gd.querySelector('.main-svg');
        if (!svg) continue;
        const f = svg.getBoundingClientRect();
        for (const t of gd.querySelectorAll('.main-svg text')) {
          const r = t.getBoundingClientRect();
          const txt = (t.textContent || '').trim();
          if (!txt || r.width === 0) continue;
          if (r.left < f.left - 1 || r.right > f.right + 1 || r.top < f.top - 1 || r.bottom > f.bottom + 1)
            add('clipped text', `"${txt.slice(0, 40)}" at ${Math.round(r.left - f.left)},${Math.round(r.top - f.top)} `
                + `(${Math.round(r.width)}x${Math.round(r.height)}) in a ${Math.round(f.width)}x${Math.round(f.height)} figure`);
        }
        for (const bar of gd.querySelectorAll('.legend .scrollbar')) {
          const r = bar.getBoundingClientRect();
          if (r.height > 0 && r.width > 0) add('legend scrolls', 'the legend has a scrollbar');
        }
      }
    });
  });
  return out;
}"""

_JS_OPEN_SIDEBAR = """() => {
  const app = window.jupyterapp;
  if (app.shell.leftCollapsed) app.commands.execute('filebrowser:activate');
  return !app.shell.leftCollapsed;
}"""


def open_sidebar(page) -> None:
    """Show the file browser in the left sidebar (what a new user sees)."""
    page.evaluate(_JS_OPEN_SIDEBAR)
    page.wait_for_function("() => !window.jupyterapp.shell.leftCollapsed", timeout=30_000)
    page.wait_for_timeout(500)  # the notebook panel re-lays out


def layout_problems(page) -> list:
    """Every layout problem in the current notebook's outputs (see the module docstring)."""
    return page.evaluate(_JS_PROBLEMS)


_JS_DRAWN = ("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
             ".every(g => g._fullLayout && g.querySelector('.main-svg') && g._fullData"
             " && g._fullData.length)")


def settle_plots(page, timeout_s: float = 90.0) -> None:
    """Wait until every plotly figure has drawn its traces, then a moment more for widget
    views to size themselves. A figure still without traces after ``timeout_s`` is left
    for :func:`layout_problems` to report ("empty figure")."""
    try:
        page.wait_for_function(_JS_DRAWN, timeout=timeout_s * 1000, polling=250)
    except Exception:  # noqa: BLE001 - reported as a problem, with the cell it is in
        pass
    page.wait_for_timeout(1000)


def describe(problems: list) -> str:
    return "\n".join(f"cell {p['cell']} output {p['output']}: {p['kind']}: {p['detail']}"
                     for p in problems)
