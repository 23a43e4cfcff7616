"""The notebooks' prose against what the widgets draw (no kernel, no ranks).

* Every colour a markdown cell names must be the colour of the legend entry it describes
  ("the mauve all-reduce bars"): the colour word is paired with the nearest legend term in
  the same clause and checked against ``labkit_widgets._style.COLOR_NAMES``.
* No notebook ends by closing its cluster: the first click on a view after Run All must find
  warm ranks, not pay a cold start.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit_widgets import _style as S
from labkit_widgets.checkpoint_view import ALIVE, OP_COLORS

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def legend_colors() -> dict:
    """Legend term as prose writes it -> the set of colours it has in some view."""
    terms: dict = {}

    def add(term, color):
        terms.setdefault(term, set()).add(color.upper())

    for fam, c in S.COMPUTE_COLORS.items():
        add(fam, c)
    for op, c in S.COMM_COLORS.items():
        add(op.replace("_", "-"), c)
        add(op, c)
    for term in ("send", "recv", "send/recv"):
        add(term, S.COMM_COLORS["p2p"])
    add("blocked", S.BLOCKED_COLOR)
    for cat, c in S.MEMORY_COLORS.items():
        add(cat, c)
    for op, c in OP_COLORS.items():
        add(op, c)
    add("stored", ALIVE)
    return terms


COLOR_WORDS = sorted({w for names in S.COLOR_NAMES.values() for w in names}, key=len,
                     reverse=True)
_COLOR_RE = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, COLOR_WORDS)) + r")(?![\w-])",
                       re.I)
# clauses: a colour and the thing it names sit in one clause
_CLAUSE_RE = re.compile(r"(?<=[.;:!?])\s+|\n\s*\n")


def named_colors(text: str, terms: dict) -> list:
    """``[(colour word, legend term, clause)]`` for every colour named next to a legend term."""
    term_re = re.compile(r"(?<![\w-])(" + "|".join(
        map(re.escape, sorted(terms, key=len, reverse=True))) + r")(?![\w-])", re.I)
    found = []
    for clause in _CLAUSE_RE.split(text):
        colours = [(m.start(), m.group(1).lower()) for m in _COLOR_RE.finditer(clause)]
        taken = {(m.start(), m.end()) for m in _COLOR_RE.finditer(clause)}
        things = [(m.start(), m.group(1).lower()) for m in term_re.finditer(clause)
                  if not any(a <= m.start() < b for a, b in taken)]
        for pos, word in colours:
            if things:
                _, term = min(things, key=lambda t: abs(t[0] - pos))
                found.append((word, term, clause.strip()))
    return found


def _markdown(nb_path: Path) -> list:
    nb = nbformat.read(nb_path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def test_pairing_finds_the_named_thing():
    terms = legend_colors()
    pairs = named_colors("Pick step 2: the mauve all-reduce bars start inside the orange "
                         "backward bar; the grey bars are the time the rank sat blocked.", terms)
    assert [(w, t) for w, t, _ in pairs] == [("mauve", "all-reduce"), ("orange", "backward"),
                                             ("grey", "blocked")]


def _wrong(pairs, terms) -> list:
    bad = []
    for word, term, clause in pairs:
        names = {n for c in terms[term] for n in S.COLOR_NAMES.get(c, ())}
        if word not in names:
            bad.append(f"{word!r} for {term!r} (its colour is called "
                       f"{' / '.join(sorted(names)) or 'nothing'}): {clause[:120]}")
    return bad


def test_the_check_catches_a_wrong_colour():
    """The two sentences a reader found wrong in the browser must fail the check."""
    terms = legend_colors()
    for text in ("the blue all-reduce bars of the bucketed run start inside the backward bar",
                 "the grey bars are the time the rank sat blocked (issuing or waiting)"):
        assert _wrong(named_colors(text, terms), terms), text


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_named_colours_match_the_legend(nb_path):
    terms = legend_colors()
    bad = [b for text in _markdown(nb_path) for b in _wrong(named_colors(text, terms), terms)]
    assert not bad, "\n".join(bad)


def test_every_colour_has_a_prose_name():
    used = set(S.COMPUTE_COLORS.values()) | set(S.COMM_COLORS.values()) | {S.BLOCKED_COLOR} \
        | set(S.MEMORY_COLORS.values()) | set(OP_COLORS.values()) | {ALIVE}
    assert {c.upper() for c in used} <= {c.upper() for c in S.COLOR_NAMES}


_STILL_CLOSING: set = set()  # notebooks allowed to end with cluster.close() (none)


@pytest.mark.parametrize("nb_path", [
    pytest.param(p, marks=pytest.mark.xfail(reason="still ends with cluster.close()"))
    if p.stem in _STILL_CLOSING else p for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_leaves_its_cluster_warm(nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code and not re.search(r"\.close\(\)\s*$", code[-1]), (
        f"{nb_path.name} ends with {code[-1]!r}: the first widget click after Run All would "
        "pay a cold start; kernel shutdown stops the ranks anyway")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_opens_unmodified(path):
    """JupyterLab writes the kernel's spec and language into a notebook's metadata when its
    kernel starts; a notebook stored with others opens with unsaved changes (the browser
    test tests/browser/test_notebooks_open_clean.py watches the tab)."""
    from jupyter_client.kernelspec import get_kernel_spec

    spec = get_kernel_spec("python3")
    meta = nbformat.read(path, as_version=4).metadata
    assert meta.kernelspec == {"display_name": spec.display_name, "language": spec.language,
                               "name": "python3"}
    assert meta.language_info.name == "python"
    assert meta.language_info.pygments_lexer == "ipython3"


# -- prose and screen agree --------------------------------------------------------------
# A markdown sentence that states a relation between values on screen ("halves", "equal to the
# prediction", "the view shows the last step") is quoted by a ``# PROSE_CHECK`` cell after it,
# whose ``check(phrase, condition)`` (labkit_widgets.prose) nbval runs with every notebook.
from labkit_widgets.prose import MARK as PROSE_MARK  # noqa: E402

_RELATION = re.compile(
    r"\b(larger|smaller|bigger|halves|halved|doubles|doubled|twice|quadruples|equals?|"
    r"matches|the same as|exactly|higher|lower|wider than|narrower than|more than|fewer|"
    r"less than|grows|falls|drops|"
    r"flat|the view (?:below |above )?shows|lights? up|last step|step \d+|byte for byte|"
    r"to the byte)\b", re.I)
_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_CLAUSE = re.compile(r"(?<=;)\s+")
_POINTER = re.compile(r"\b(above|below|view)\b")
#: a sentence introducing a table or figure: what the rest of its paragraph says of "that
#: range" is read off it
_INTRODUCES = re.compile(r"\b(table|view|figure|plot|printout)\s+(above|below)\s+shows\b",
                         re.I)
_CHECK_CALL = re.compile(r"""\bcheck\(\s*(["'])((?:\\.|(?!\1).)*)\1""", re.S)

#: sentences the relation words flag that state no relation between values on screen:
#: (notebook stem, start of the sentence) -> why
TIMING = "a timing on a shared CPU: printed by a *reading* line, never asserted (benchmarks/)"
NOT_ABOUT_VALUES_ON_SCREEN = {
    ("00", "With `dp=4` each rank takes a quarter"): "a promise notebook 02's parity cells check",
    ("00", "The last step ran under torch's `MemTracker`"): TIMING,
    ("01", "Whether the ratio rises or falls"): TIMING,
    ("01", "How far under 1 each row lands is not fixed"): TIMING,
    ("02", "ZeRO (notebook 03) removes the replication"): "points to notebook 03, checked there",
    ("02", "2018 (*An Empirical Model of Large-Batch Training*)"): "McCandlish et al.'s law, "
                                                                   "quoted; the cell after "
                                                                   "measures B_simple",
    ("02", "For the mesh: `dp × micro-batch × accumulation steps`"): "advice for choosing the "
                                                                   "mesh from B_simple",
    ("03", "The last step runs under torch's `MemTracker`"): "describes the tool",
    ("05", "The job below trains with a policy and counts FLOPs twice"): "describes the method",
    ("05", "Each step time is the median"): "describes the method",
    ("06", "Step 1 is read below"): "names the step read; the view's step is checked in §5",
    ("06", "The usual TP bugs are far larger."): "tests/test_tensor_parallel.py plants them",
    ("07", "FlashAttention never stores that matrix"): "the lecture's premise; the cell after "
                                                      "checks the flat bytes per token",
    ("07", "So the losses of both steps and every gradient must equal"): "a prediction; the "
                                                                         "parity cell checks it",
    ("08", "Check the core count printed above"): "names the lab machine; the summary line "
                                                  "prints the cores the ranks got",
    ("08", "Stage costs are not equal"): TIMING,
    ("08", "Look at the F span column"): TIMING,
    ("08", "As `M` grows these fixed costs weigh more"): TIMING,
    ("08", "With fewer cores than ranks, or with other work loading"): TIMING,
    ("09", "A larger capacity factor drops less"): "a knob to try in the view, not shown",
    ("09", "With a capacity, parity also requires"): "a requirement; the parity cell checks it",
    ("09", "The usual bugs leave errors orders of magnitude larger"): "tools/mutants.py "
                                                                       "plants them",
    ("10", "The check no formula gives"): "describes the method",
    ("11", "Daly (2006) gave the expected wall time"): "cites the paper; the curve below "
                                                        "is computed from its formula",
    ("12", "On a machine with two cores and four ranks"): TIMING,
    ("12", "the launchers meet at node 0's address"): "describes the launcher; "
                                                       "tests/test_cli.py runs it",
    ("12", "CI runs the first one: `tests/test_cli.py::test_torchrun"): "names what that "
                                                                     "test asserts",
}


def _norm(text: str) -> str:
    return " ".join(text.replace("\\n", " ").split()).lower()


def prose_checks(nb) -> list:
    """``[(markdown index, [quoted phrases], code index)]`` for every ``# PROSE_CHECK`` cell;
    the markdown is the nearest one above it."""
    out, last_md = [], None
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            last_md = i
        elif c.source.startswith(PROSE_MARK):
            out.append((last_md, [m.group(2) for m in _CHECK_CALL.finditer(c.source)], i))
    return out


def value_claims(nb) -> list:
    """``[(markdown index, sentence)]``: the sentences stating a relation about what is on
    screen: commentary right after a code cell, a sentence pointing at a view or an output
    ("above", "below", "view"), or one later in a paragraph that introduced a table ("the table
    below shows"). A ";" clause pointing at a view is one with its sentence's relation word.
    The notebook's opening cell and *Predict* questions are not claims."""
    found, before = [], None   # the cell before, check cells skipped
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code" and c.source.startswith(PROSE_MARK):
            continue
        after_code, before = before == "code", c.cell_type
        if c.cell_type != "markdown" or i == 0:
            continue
        text = "\n".join(line for line in c.source.splitlines()
                         if not line.lstrip().startswith("#"))   # headings name, not claim
        for paragraph in _PARAGRAPH.split(text):
            introduced = False
            for sentence in _SENTENCE.split(paragraph):
                introduced = introduced or bool(_INTRODUCES.search(sentence))
                # a claim is a clause (split at ";"), but its relation word may sit in the
                # clause before: "(it grows as the loss falls; the run above shows it growing)"
                for s in _CLAUSE.split(sentence):
                    if "predict" in s.lower() or s.lstrip().startswith("#") or "?" in s:
                        continue
                    pointer = _POINTER.search(s)
                    if ((after_code or introduced or pointer) and _RELATION.search(s)
                            or pointer and _RELATION.search(sentence)):
                        found.append((i, " ".join(s.split())))
    return found


def _exempt(stem: str, sentence: str) -> bool:
    return any(s == stem and sentence.startswith(start)
               for s, start in NOT_ABOUT_VALUES_ON_SCREEN)


def unchecked_claims(nb, stem: str) -> list:
    quoted: dict = {}
    for md, phrases, _ in prose_checks(nb):
        quoted.setdefault(md, []).extend(_norm(p) for p in phrases)
    return [f"cell {i}: {s}" for i, s in value_claims(nb)
            if not _exempt(stem, s) and not any(p in _norm(s) for p in quoted.get(i, []))]


def test_the_claim_finder_flags_what_the_reader_found():
    """The two sentences issue 25 found contradicted on screen are flagged, and a check
    quoting them clears them."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell("r = 1"),
                nbformat.v4.new_markdown_cell(
                    "Each ring now carries one sequence instead of two, so the `cp` traffic "
                    "halves. The view below shows the run without the auxiliary loss, at its "
                    "last step. *Predict:* which is larger?")]
    assert [s for _, s in value_claims(nb)] == [
        "Each ring now carries one sequence instead of two, so the `cp` traffic halves.",
        "The view below shows the run without the auxiliary loss, at its last step."]
    assert len(unchecked_claims(nb, "x")) == 2
    nb.cells.append(nbformat.v4.new_code_cell(
        PROSE_MARK + '\ncheck("the `cp` traffic halves", True)\n'
        'check("the run without the auxiliary loss, at its last step", True)'))
    assert unchecked_claims(nb, "x") == []


def test_the_claim_finder_reads_a_paragraph_and_a_sentence_whole():
    """What a sentence introducing a table says of it later in its paragraph is a claim, and
    a clause pointing at a view is one when its relation word sits before the ";"; the next
    paragraph, and a relation with no pointer, are not."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_markdown_cell(
        "The scale changes (the paper finds it grows as the loss falls; the run above shows "
        "it growing), so each run differs.\n\nThe table\nbelow shows each run's spread. In "
        "every run that range is wider than the medians' range.\n\nThat range is wider than the "
        "medians' range in most runs.")]
    assert [s for _, s in value_claims(nb)] == [
        "the run above shows it growing), so each run differs.",
        "In every run that range is wider than the medians' range."]


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_value_claim_is_checked(nb_path):
    """Every sentence stating a relation between values on screen is quoted by a check cell
    after it (before the next markdown), or listed as not about values on screen."""
    nb = nbformat.read(nb_path, as_version=4)
    bad = unchecked_claims(nb, nb_path.stem[:2])
    assert not bad, ("prose states a relation no PROSE_CHECK cell asserts (quote it in "
                     "check(...) after it, see labkit_widgets.prose):\n" + "\n".join(bad))


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.stem)
def test_checks_quote_the_markdown_above(nb_path):
    """A check's phrase is verbatim in the markdown just above (so it checks that sentence),
    and a check cell stores no output (nbval re-runs it; it prints only ✓ lines)."""
    nb = nbformat.read(nb_path, as_version=4)
    bad = []
    for md, phrases, code in prose_checks(nb):
        assert phrases, f"cell {code}: a PROSE_CHECK cell without check(...)"
        assert not nb.cells[code].outputs, f"cell {code}: a PROSE_CHECK cell stores output"
        assert "prose-check" in nb.cells[code].metadata.get("tags", []), code
        text = _norm(nb.cells[md].source) if md is not None else ""
        bad += [f"cell {code}: {p!r} is not in markdown cell {md}" for p in phrases
                if _norm(p) not in text]
    assert not bad, "\n".join(bad)


def test_exemptions_name_real_sentences():
    sentences = {(p.stem[:2], s) for p in NOTEBOOKS
                 for _, s in value_claims(nbformat.read(p, as_version=4))}
    stale = [k for k in NOT_ABOUT_VALUES_ON_SCREEN
             if not any(stem == k[0] and s.startswith(k[1]) for stem, s in sentences)]
    assert not stale, stale


def test_08_states_the_load_through_the_cores_the_view_reports():
    """Notebook 08 says what load does to the measured bubble through the cores the view's
    note reports, checked beside it, and quotes no measured figure (a loaded machine once
    read 42 % against 20.6 % simulated; such numbers move from run to run)."""
    nb = nbformat.read(next(p for p in NOTEBOOKS if p.stem.startswith("08")), as_version=4)
    (i, text), = [(i, c.source) for i, c in enumerate(nb.cells)
                  if c.cell_type == "markdown" and "the cores in the note" in c.source]
    assert not re.search(r"\d", text), text
    checked = [p for md, phrases, _ in prose_checks(nb) if md == i for p in phrases]
    assert any("note under the table says how many they got" in _norm(p) for p in checked)
    # a loaded run read 36.7 % against 34.9 % simulated, and runs that got 0.64 and 0.94
    # cores read gaps of +0.7 and +13.1 points: load can open a gap, not always, and the
    # cores do not size it, so the paragraph may not say either
    words = _norm(text)
    for unconditional in ("then reads far above", "explain the gap", "waits for a core,"):
        assert unconditional not in words, unconditional
    assert "can then read far above" in words and "cores in the note first" in words


def test_08_reading_lines_describe_what_the_numbers_do():
    """The reading line under §3's table once printed "stops falling; lowest at M=8" for
    0.272 → 0.277 → 0.244 (it fell again) and "lowest at M=4" beside a rise to 0.418: the
    words must follow the numbers as printed, every step."""
    from labkit_widgets.prose import trend

    assert trend({1: 0.5, 2: 0.272, 4: 0.277, 8: 0.244}) == (
        "falls from M=1 to M=2, rises to M=4, falls to M=8; lowest at M=8")
    assert trend({1: 0.5, 2: 0.45, 4: 0.35, 8: 0.418}) == (
        "falls from M=1 to M=4, rises to M=8; lowest at M=4")
    assert trend({1: 0.5, 2: 0.33, 4: 0.2, 8: 0.11}) == "falls at every step from M=1 to M=8"
    assert trend({1: 0.1, 2: 0.2}) == "rises at every step from M=1 to M=2"
    # equal as printed (3 decimals) is level, not a rise; ties name every lowest M
    assert trend({1: 0.3, 2: 0.2501, 4: 0.2504, 8: 0.3}) == (
        "falls from M=1 to M=2, stays level to M=4, rises to M=8; lowest at M=2 and M=4")
    with pytest.raises(ValueError, match="two readings"):
        trend({1: 0.3})
    nb = nbformat.read(next(p for p in NOTEBOOKS if p.stem.startswith("08")), as_version=4)
    table = next(c.source for c in nb.cells if c.cell_type == "code"
                 and "(P-1)/(M+P-1)" in c.source)
    assert 'trend(measured)' in table and "stops falling" not in table
