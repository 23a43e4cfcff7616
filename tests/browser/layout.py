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
* ``"empty figure"`` — a plotly figure that drew no traces;
* ``"squeezed data"`` — the traces on a linear or log axis (with the reference lines and
  bands drawn on it as shapes) span under :data:`SQUEEZE` of its range (an annotation or a
  fixed range stretched the axis);
* ``"annotation outside plot"`` — an annotation placed in data coordinates whose drawn box
  leaves its subplot's plot area (along the axes it is placed on);
* ``"overprinted labels"`` — two annotations drawn over each other;
* ``"squashed plot"`` — a figure with axes whose plot area is under half its height (the
  margins, e.g. a title's default top margin in a short figure, take the rest);
* ``"hidden markers"`` — every marker of a trace of two or more markers lies within 3 px of
  a marker of another trace (two runs that agree drawn at the same x: the reader sees one;
  a single marker drawn over another is a highlight, not counted);
* ``"label under legend"`` — a tick label, axis title, title or annotation that the legend
  box covers;
* ``"hidden scroll"`` — an element of an output that clips or scrolls its content
  (``overflow`` hidden, auto or scroll) and holds more than it shows
  (``scrollHeight > clientHeight``).

``explorer`` is true for outputs that hold the explorer (its history table), so a test can
report those separately. ``open_sidebar(page)`` opens the file browser, as a new user
has it, which leaves the notebook about 830 px of output width in a 1280 px window.
Outputs inside a widget (a figure's own output area) count as part of the cell's output.
"""
from __future__ import annotations

#: the least fraction of an axis's range that its traces' data must span
SQUEEZE = 0.3

_JS_PROBLEMS = r"""(squeeze) => {
  const out = [];
  const name = el => el.tagName.toLowerCase() + (el.className && el.className.baseVal === undefined
      ? '.' + String(el.className).trim().split(/\s+/).slice(0, 2).join('.') : '');
  const canvas = document.createElement('canvas').getContext('2d');
  const title = gd => String(((gd._fullLayout || {}).title || {}).text || '(untitled)')
      .replace(/<[^>]+>/g, ' ').slice(0, 50);
  const arr = v => v == null ? [] : ArrayBuffer.isView(v) ? Array.from(v)
      : Array.isArray(v) ? v : [v];
  const overlap = (a, b) => Math.max(0, Math.min(a.right, b.right) - Math.max(a.left, b.left))
      * Math.max(0, Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top));
  const plotChecks = (gd, add) => {
    const fl = gd._fullLayout;
    if (!fl || !gd._fullData) return;
    const axes = Object.keys(fl).filter(k => /^[xy]axis\d*$/.test(k)).map(k => fl[k]);
    // data squeezed into a fraction of its axis
    for (const ax of axes) {
      if (!ax.visible || !['linear', 'log'].includes(ax.type) || !ax.range) continue;
      const letter = ax._id[0];
      let lo = Infinity, hi = -Infinity, n = 0;
      // stacked bars reach the sum of their segments at one position, not any one value
      const stacked = ['stack', 'relative'].includes(fl.barmode), tops = new Map();
      for (const t of gd._fullData) {
        if (t.visible !== true || !['scatter', 'scattergl', 'bar'].includes(t.type)) continue;
        if ((letter === 'x' ? t.xaxis : t.yaxis) !== ax._id) continue;
        let vals = arr(t[letter]);
        if (t.type === 'bar' && stacked && t.base == null
            && letter === (t.orientation === 'h' ? 'x' : 'y')) {
          const pos = arr(t[letter === 'y' ? 'x' : 'y']);
          vals.forEach((v, i) => {
            if (v == null || !isFinite(+v)) return;
            const key = JSON.stringify([pos[i] ?? i, t.offsetgroup || '']);
            const [neg, posSum] = tops.get(key) || [0, 0];
            tops.set(key, +v < 0 ? [neg + +v, posSum] : [neg, posSum + +v]);
          });
          continue;
        }
        if (t.type === 'bar' && letter === (t.orientation === 'h' ? 'x' : 'y')) {
          const base = t.base, out = [];  // a bar spans base .. base + value
          vals.forEach((v, i) => {
            if (v == null || !isFinite(+v)) return;
            const b = base == null ? 0 : +(arr(base).length > 1 ? arr(base)[i] : arr(base)[0]);
            out.push(b, b + +v);
          });
          vals = out;
        }
        for (let v of vals) {
          if (v == null || v === '' || !isFinite(+v)) continue;
          v = +v;
          if (ax.type === 'log') { if (v <= 0) continue; v = Math.log10(v); }
          lo = Math.min(lo, v); hi = Math.max(hi, v); n++;
        }
      }
      for (const [neg, posSum] of tops.values()) {
        for (let v of [neg, posSum]) {
          if (ax.type === 'log') { if (v <= 0) continue; v = Math.log10(v); }
          lo = Math.min(lo, v); hi = Math.max(hi, v); n++;
        }
      }
      // a reference line or band the figure draws on this axis (a capacity, a bound) is
      // content too: an axis ranged to show it is not stretched by nothing
      for (const sh of (fl.shapes || [])) {
        if (sh.visible === false || (letter === 'x' ? sh.xref : sh.yref) !== ax._id) continue;
        for (let v of [sh[letter + '0'], sh[letter + '1']]) {
          if (v == null || !isFinite(+v)) continue;
          v = +v;
          if (ax.type === 'log') { if (v <= 0) continue; v = Math.log10(v); }
          lo = Math.min(lo, v); hi = Math.max(hi, v);
        }
      }
      const r = ax.range.map(Number), span = Math.abs(r[1] - r[0]);
      if (n < 2 || !(hi > lo) || !(span > 0)) continue;
      const frac = (hi - lo) / span;
      if (frac < squeeze)
        add('squeezed data', `"${title(gd)}": the data on ${ax._name} spans `
            + `${Math.round(100 * frac)} % of its range (${ax.type} ${lo.toPrecision(3)}..`
            + `${hi.toPrecision(3)} in ${r[0].toPrecision(3)}..${r[1].toPrecision(3)})`);
    }
    // an annotation in data coordinates drawn outside its subplot's plot area
    const svg = gd.querySelector('.main-svg').getBoundingClientRect();
    (fl.annotations || []).forEach((a, i) => {
      if (a.visible === false) return;
      const g = gd.querySelector(`.annotation[data-index="${i}"]`);
      if (!g) return;
      const r = g.getBoundingClientRect();
      if (!r.width) return;
      const bad = [];
      for (const [ref, letter] of [[a.xref, 'x'], [a.yref, 'y']]) {
        if (!ref || ref === 'paper' || / domain$/.test(ref)) continue;
        const ax = fl[ref[0] + 'axis' + ref.slice(1)];
        if (!ax || ax._offset == null) continue;
        const p0 = (letter === 'x' ? svg.left : svg.top) + ax._offset, p1 = p0 + ax._length;
        const [s0, s1] = letter === 'x' ? [r.left, r.right] : [r.top, r.bottom];
        if (s0 < p0 - 2 || s1 > p1 + 2) bad.push(letter);
      }
      if (bad.length)
        add('annotation outside plot', `"${title(gd)}": annotation "${String(a.text)
            .replace(/<[^>]+>/g, ' ').slice(0, 40)}" leaves the plot area along ${bad.join(', ')}`);
    });
    // two annotations printed over each other (labels of two nearby reference lines)
    const notes = (fl.annotations || []).map((a, i) => [a, gd.querySelector(`.annotation[data-index="${i}"]`)])
      .filter(([a, g]) => a.visible !== false && g && g.getBoundingClientRect().width)
      .map(([a, g]) => [String(a.text).replace(/<[^>]+>/g, ' ').slice(0, 30), g.getBoundingClientRect()]);
    for (let i = 0; i < notes.length; i++)
      for (let j = i + 1; j < notes.length; j++)
        if (overlap(notes[i][1], notes[j][1]) > 4)
          add('overprinted labels', `"${title(gd)}": annotations "${notes[i][0]}" and "${notes[j][0]}" overlap`);
    // a plot area squeezed by the margins (a title's default top margin in a short figure)
    if (axes.length && fl._size && fl._size.h < 0.5 * fl.height)
      add('squashed plot', `"${title(gd)}": the plot area is ${Math.round(fl._size.h)} px `
          + `of a ${Math.round(fl.height)} px figure (margins t ${fl.margin.t}, b ${fl.margin.b})`);
    // a trace's markers all drawn at the points of another trace: one hides the other
    const pts = Array.from(gd.querySelectorAll('.scatterlayer .trace')).map(tr => {
      const d = tr.__data__ && tr.__data__[0] && tr.__data__[0].trace;
      const c = Array.from(tr.querySelectorAll('.points path.point')).map(p => {
        const r = p.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2];
      }).filter(([x, y]) => isFinite(x) && isFinite(y));
      return [d ? String(d.name) : '?', c];
    }).filter(([, c]) => c.length > 1);   // one marker over another is a highlight ("now")
    pts.forEach(([nm, c], i) => {
      const other = pts.find(([, c2], j) => j !== i
          && c.every(([x, y]) => c2.some(([x2, y2]) => Math.hypot(x - x2, y - y2) < 3)));
      if (other)
        add('hidden markers', `"${title(gd)}": every marker of "${nm}" lies on one of `
            + `"${other[0]}"`);
    });
    // a label under the legend
    const leg = gd.querySelector('.legend .bg');
    if (leg && fl.showlegend !== false) {
      const lr = leg.getBoundingClientRect();
      if (lr.width && lr.height) {
        const labels = gd.querySelectorAll('.xtick text, .ytick text, .xtick2 text, '
            + '.g-xtitle text, .g-ytitle text, .g-gtitle text, .annotation-text, '
            + '[class*="tick"] text');
        for (const t of labels) {
          if (t.closest('.legend')) continue;
          const tr = t.getBoundingClientRect();
          const txt = (t.textContent || '').trim();
          if (!txt || !tr.width) continue;
          if (overlap(tr, lr) > 4) {
            add('label under legend', `"${title(gd)}": the legend covers "${txt.slice(0, 40)}"`);
            break;
          }
        }
      }
    }
  };
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
      // a figure output is itself the plot element; a widget's figures sit inside it
      for (const gd of [o, ...o.querySelectorAll('.js-plotly-plot')]) {
        if (!gd.classList.contains('js-plotly-plot')) continue;
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
        plotChecks(gd, add);
      }
      for (const el of o.querySelectorAll('*')) {
        if (el.closest('.js-plotly-plot')) continue;  // plotly: its legend is checked above
        if (el.clientHeight === 0) continue;
        const cs = getComputedStyle(el);
        if (!['auto', 'scroll', 'hidden'].includes(cs.overflowY)) continue;
        if (el.scrollHeight > el.clientHeight + 2)
          add('hidden scroll', `${name(el)} shows ${el.clientHeight} of ${el.scrollHeight} px `
              + `(overflow-y ${cs.overflowY}): "${(el.innerText || '').trim().slice(0, 50)}…"`);
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


def layout_problems(page, squeeze: float = SQUEEZE) -> list:
    """Every layout problem in the current notebook's outputs (see the module docstring)."""
    return page.evaluate(_JS_PROBLEMS, squeeze)


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
