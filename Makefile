# labkit developer commands (GNU make).
#   make lab    -- JupyterLab on http://127.0.0.1:8888 (loopback only), notebooks/ as root;
#                  make lab PORT=8890 picks the port. A port in use: Jupyter says "The port
#                  8888 is already in use, trying another port" and serves on the next free
#                  one (8889, 8890, ...): open the URL it prints. JUPYTER_PORT_RETRIES=0
#                  make lab fails instead.
#   make test   -- unit + browser tests and nbval over notebooks/*.ipynb, in two streams
#                  at once (JOBS=2, the default; JOBS=1: one after the other)
#   make bench  -- run every benchmarks/*.py
#   make sweep  -- random compositions against the independent oracle (N=40, SEED=0)
#   make mutants -- plant each one-line bug of tools/mutants.py, run the tests that must catch
#                   it, print caught/total and the survivors (slow; not part of CI).
#                   MUTANTS_ARGS="--only NAME" or "--list" narrow it
#   make clean  -- remove build/test debris (keeps .venv);  make distclean also drops .venv
# Everything runs from .venv, created on demand with the pinned versions in constraints.txt.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

PYTHON   ?= python3
# pip's verbosity for building .venv: -qq shows errors only (a pip config with extra
# file:// indexes otherwise prints a "Location ... is ignored" warning per package);
# PIP_QUIET=-q shows warnings too, PIP_QUIET= pip's whole progress
PIP_QUIET ?= -qq
VENV     := .venv
VPY      := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium
# make lab's port (Jupyter moves to the next free port when this one is taken)
PORT     ?= 8888
# nbval mode: --nbval-lax runs every cell (any exception fails) and compares outputs
# only for cells marked `# NBVAL_CHECK_OUTPUT`; see docs/SETUP_NOTES.md for why.
NBVAL    ?= --nbval-lax
# Jupyter refuses to start as root unless told so (CI runs as root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: help .venv venv lab test chromium bench sweep critical-batch mutants clean distclean

help:
	@echo "make lab | test | bench | sweep | critical-batch | mutants | clean | distclean | .venv"
	@echo "  make lab PORT=8890   JupyterLab on http://127.0.0.1:8890 (default PORT=8888); a port"
	@echo "                       in use makes Jupyter take the next free one (8889, ...): open"
	@echo "                       the URL it prints; JUPYTER_PORT_RETRIES=0 make lab fails instead"

# ---------------------------------------------------------------- virtualenv
.venv venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(PIP_QUIET) --upgrade pip

# Re-installs whenever pyproject.toml or constraints.txt change.
$(STAMP): pyproject.toml constraints.txt | $(VPY)
	@echo "make: installing labkit and the pinned versions of constraints.txt into $(VENV) (minutes on a fresh clone; pip $(PIP_QUIET): errors only, PIP_QUIET=-q adds pip's warnings)"
	$(VPY) -m pip install $(PIP_QUIET) -c constraints.txt -e ".[lab,dev]"
	@$(VPY) -c "import importlib.metadata as m, torch, labkit, labkit_widgets; print('torch', torch.__version__, '| labkit', m.version('labkit'))"
	@touch $@

# ---------------------------------------------------------------- lab
# JupyterLab's defaults for this environment only: no "receive official news?" prompt
# and no update check (the lab's machines may have no internet).
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_OVERRIDES): | $(STAMP)
	@mkdir -p $(@D)
	@echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' > $@

lab: $(STAMP) $(LAB_OVERRIDES)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --port=$(PORT) --no-browser --notebook-dir=notebooks $(ALLOW_ROOT)

# ---------------------------------------------------------------- test
# Browser tests need $(CHROMIUM).  As root we apt-get it; otherwise we warn: the browser
# tests then skip, except under CI=true where they fail.
chromium:
	@if [ -x "$(CHROMIUM)" ]; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing chromium with apt-get"; \
	  apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  "$(CHROMIUM)" --version; \
	elif [ -n "$${CI:-}" ]; then \
	  echo "make: WARNING $(CHROMIUM) is missing and we are not root -- browser tests will FAIL (CI is set)"; \
	else \
	  echo "make: WARNING $(CHROMIUM) is missing and we are not root -- browser tests will be SKIPPED"; \
	  echo "      install it with: sudo apt-get install chromium"; \
	fi

# Runs the pytest suite and nbval; all always run, the target fails if any fails.
# pytest's exit code 5 ("no tests collected") counts as a failure for tests/; for
# notebooks/ we only call nbval when there is at least one notebook.
# JOBS=2 (default) runs two streams at once: (A) tests/ without tests/browser, live, and
# (B) tests/browser then nbval, into tests/artifacts/stream-b.log, printed when A ends.
# Much of the suite keeps one core busy (one process computing, or ranks and kernels
# starting), so on 2 cores the second stream uses what the first leaves idle; each test
# and notebook runs exactly as in one stream. JOBS=1 runs tests/ whole, then nbval.
JOBS ?= 2
PYTEST_TESTS = $(VPY) -m pytest -q -ra --durations=25
PYTEST_NBVAL = $(VPY) -m pytest -q -ra --durations=15 $(NBVAL) --nbval-current-env \
	--nbval-sanitize-with tests/nbval_sanitize.cfg
test: $(STAMP) chromium
	@start=$$(date +%s); rc=0; \
	mapfile -t nbs < <(find notebooks -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' 2>/dev/null | sort); \
	nbval() { \
	  if [ $${#nbs[@]} -eq 0 ]; then \
	    echo "== nbval: no notebooks under notebooks/ yet -- skipped"; \
	  else \
	    echo "== nbval ($(NBVAL)) on $${#nbs[@]} notebook(s)"; \
	    $(PYTEST_NBVAL) "$${nbs[@]}"; \
	  fi; \
	}; \
	if [ "$(JOBS)" = 1 ]; then \
	  echo "== pytest tests/"; \
	  $(PYTEST_TESTS) tests || rc=$$?; \
	  echo "== pytest tests/: $$(( $$(date +%s) - start )) s, exit $$rc"; \
	  nbval || { r=$$?; [ $$rc -ne 0 ] || rc=$$r; }; \
	else \
	  mkdir -p tests/artifacts; blog=tests/artifacts/stream-b.log; \
	  ( b=0; echo "== pytest tests/browser"; \
	    $(PYTEST_TESTS) tests/browser || b=$$?; \
	    echo "== pytest tests/browser: $$(( $$(date +%s) - start )) s, exit $$b"; \
	    nbval || { r=$$?; [ $$b -ne 0 ] || b=$$r; }; \
	    echo "== stream B (browser tests, nbval): $$(( $$(date +%s) - start )) s, exit $$b"; \
	    exit $$b ) > "$$blog" 2>&1 & bpid=$$!; \
	  echo "== pytest tests/ --ignore=tests/browser (stream A; stream B: browser tests, then nbval, into $$blog)"; \
	  $(PYTEST_TESTS) --ignore=tests/browser tests || rc=$$?; \
	  echo "== pytest tests/ without browser: $$(( $$(date +%s) - start )) s, exit $$rc"; \
	  wait $$bpid || { r=$$?; [ $$rc -ne 0 ] || rc=$$r; }; \
	  echo "== stream B, as it ran ($$blog):"; cat "$$blog"; \
	fi; \
	echo "== make test: total wall time $$(( $$(date +%s) - start )) s, exit $$rc"; \
	exit $$rc

# ---------------------------------------------------------------- bench
bench: $(STAMP)
	@shopt -s nullglob; files=(benchmarks/*.py); rc=0; \
	[ $${#files[@]} -gt 0 ] || echo "no benchmarks/*.py yet"; \
	for f in "$${files[@]}"; do \
	  echo "== $$f"; $(VPY) "$$f" || { rc=$$?; echo "!! $$f failed (exit $$rc)"; }; \
	done; \
	exit $$rc

# ---------------------------------------------------------------- sweep
# Not in CI: N random compositions of the training job, each checked on every rank against
# the single-process oracle in tests/oracle; prints every disagreement and a summary line.
N    ?= 40
SEED ?= 0
sweep: $(STAMP)
	$(VPY) benchmarks/matrix_sweep.py --n $(N) --seed $(SEED)

# ---------------------------------------------------------------- critical batch
# Not in CI (minutes): steps to a target loss at several global batches beside
# McCandlish et al.'s S/S_min = 1 + B_noise/B, with B_noise measured (claim C40).
critical-batch: $(STAMP)
	$(VPY) benchmarks/critical_batch.py $(CB_ARGS)

# ---------------------------------------------------------------- mutants
MUTANTS_ARGS ?=
mutants: $(STAMP)
	$(VPY) tools/mutants.py $(MUTANTS_ARGS)

# ---------------------------------------------------------------- clean
clean:
	rm -rf build dist *.egg-info tests/artifacts .pytest_cache
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print0 \
	  | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)
