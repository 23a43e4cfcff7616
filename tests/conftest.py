"""Shared pytest fixtures for labkit.

Harness section (project set-up):
    artifacts_dir      tests/artifacts/ (created; gitignored) for screenshots, traces, logs
    start_jupyter      factory: start_jupyter(root_dir) -> JupyterServer (session-scoped;
                       every server it started is stopped at the end of the session)
    jupyter_server     a JupyterLab server rooted at notebooks/ -> unpacks as (url, token)
    chromium_browser   Playwright sync Browser on headless Debian chromium
    browser_page       a fresh 1400x900 page per test; on failure a screenshot and the
                       browser console land in tests/artifacts/

Notebook section:
    cells              the stored code cells of the notebook the test module names as ``NB``
                       (module-scoped; helpers for their outputs in tests/notebook_outputs.py)

Browser tests skip when /usr/bin/chromium (or $LABKIT_CHROMIUM) is missing, except under
CI=true, where they fail instead.  The recipe for driving JupyterLab is in
tests/browser/test_harness.py; the helpers in tests/browser/helpers.py.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Calibrate CPU peaks into a cache private to this test session (rank processes inherit
    the variable), so a value measured earlier on a busy machine cannot skew MFU here."""
    import tempfile

    os.environ.setdefault("LABKIT_CACHE_DIR", tempfile.mkdtemp(prefix="labkit-test-cache-"))
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
ARTIFACTS_DIR = REPO_ROOT / "tests" / "artifacts"
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root; chromium refuses its sandbox there
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    "--disable-dev-shm-usage",  # small /dev/shm in containers
]
JUPYTER_START_TIMEOUT_S = 120.0


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing_browser(reason: str):
    """Skip locally, fail in CI: a CI run must really exercise the browser."""
    if _in_ci():
        pytest.fail(f"{reason} (CI is set, so this is an error, not a skip)", pytrace=False)
    pytest.skip(reason)


# --------------------------------------------------------------------------- artifacts
@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS_DIR


# --------------------------------------------------------------------------- jupyter
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterServer(tuple):
    """A running JupyterLab server.  Unpacks as ``url, token = server``."""

    def __new__(cls, url: str, token: str, root_dir: Path, proc: subprocess.Popen, log_path: Path):
        self = super().__new__(cls, (url, token))
        self.url, self.token, self.root_dir, self.proc, self.log_path = url, token, root_dir, proc, log_path
        return self

    def api(self, path: str, method: str = "GET", timeout: float = 10.0):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def lab_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """Shut kernels down, then terminate the server's process group, then kill leftovers."""
        if self.proc.poll() is None:
            try:  # kernels live in their own sessions (jupyter_client start_new_session)
                kernels = self.api("/api/kernels", timeout=5)
            except Exception:
                kernels = []
            # together: each shutdown waits on its kernel's exit (and its rank pool's), and
            # one by one the session's dozen kernels took ~10 s of teardown
            from concurrent.futures import ThreadPoolExecutor

            def delete(k):
                try:
                    self.api(f"/api/kernels/{k['id']}", method="DELETE", timeout=10)
                except Exception:
                    pass
            with ThreadPoolExecutor(max_workers=max(1, len(kernels))) as pool:
                list(pool.map(delete, kernels))
        try:
            import psutil
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:
            descendants = []
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        for p in descendants:  # kernels etc. that escaped the process group
            try:
                if p.is_running():
                    p.kill()
            except Exception:
                pass


_LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    # every cell attached and laid out, so a test can measure outputs outside the viewport
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def _jupyterlab_data_env(env: dict) -> dict:
    """JUPYTER_PATH / JUPYTERLAB_DIR for a venv that borrows JupyterLab from another
    environment (a light venv whose packages come from elsewhere): JupyterLab's app dir and
    the prebuilt extensions (ipywidgets, anywidget, plotly) live under that other prefix,
    and without them widgets render as plain text. ``{}`` when this prefix has them."""
    if (Path(sys.prefix) / "share" / "jupyter" / "lab").is_dir():
        return {}
    import jupyterlab

    prefix = Path(jupyterlab.__file__).resolve().parents[4]  # <prefix>/lib/pythonX.Y/site-packages
    data = prefix / "share" / "jupyter"
    if not (data / "lab").is_dir():
        return {}
    paths = [str(data)] + [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    return {"JUPYTER_PATH": os.pathsep.join(paths),
            "JUPYTERLAB_DIR": env.get("JUPYTERLAB_DIR", str(data / "lab"))}


def _launch_jupyter(root_dir: Path, state_dir: Path, log_dir: Path) -> JupyterServer:
    port = _free_port()
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    # Isolated, throw-away Jupyter state: no user config, no restored workspace (which
    # would re-open old tabs), no news toast, and NO AUTOSAVE -- a browser test must
    # never write executed outputs back into notebooks/.
    for sub in ("config", "runtime", "workspaces", "settings"):
        (state_dir / sub).mkdir(parents=True, exist_ok=True)
    for plugin, settings in _LAB_SETTINGS.items():
        f = state_dir / "settings" / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(settings))
    env = dict(os.environ)
    env.update(_jupyterlab_data_env(env))
    env.update(JUPYTER_CONFIG_DIR=str(state_dir / "config"),
               JUPYTER_RUNTIME_DIR=str(state_dir / "runtime"),
               JUPYTER_PLATFORM_DIRS="1",
               PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser", "--ServerApp.open_browser=False",
        "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",  # = the deprecated --ServerApp.token
        f"--ServerApp.root_dir={root_dir}",
        "--ServerApp.allow_root=True",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp, used to run cells
        f"--LabApp.workspaces_dir={state_dir / 'workspaces'}",
        f"--LabApp.user_settings_dir={state_dir / 'settings'}",
        "--LabApp.news_url=",
        "--ServerApp.terminals_enabled=False",
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"jupyter-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=str(root_dir), env=env, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    server = JupyterServer(url, token, Path(root_dir), proc, log_path)
    deadline = time.monotonic() + JUPYTER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            server.api("/api/status", timeout=2)
            return server
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"jupyter lab did not answer /api/status within "
                               f"{JUPYTER_START_TIMEOUT_S:.0f}s:\n{server.log_tail()}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def start_jupyter(tmp_path_factory, artifacts_dir):
    """Factory fixture: ``server = start_jupyter(root_dir)``; stopped at session end."""
    servers: list[JupyterServer] = []

    def start(root_dir) -> JupyterServer:
        root_dir = Path(root_dir).resolve()
        server = _launch_jupyter(root_dir, tmp_path_factory.mktemp("jupyter-state"), artifacts_dir)
        servers.append(server)
        return server

    yield start
    # together: each stop waits on its server's shutdown (1.4-3 s: kernels and their rank
    # pools exit first), and one after another the session's five servers took 10 s
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        list(pool.map(JupyterServer.stop, servers))


@pytest.fixture(scope="session")
def jupyter_server(start_jupyter) -> JupyterServer:
    """JupyterLab rooted at notebooks/; unpacks as ``(url, token)``."""
    NOTEBOOKS_DIR.mkdir(exist_ok=True)
    return start_jupyter(NOTEBOOKS_DIR)


# --------------------------------------------------------------------------- browser
@pytest.fixture(scope="session")
def chromium_browser():
    if not os.path.exists(CHROMIUM):
        _missing_browser(f"{CHROMIUM} not found (apt-get install chromium, or set LABKIT_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:  # pragma: no cover
        _missing_browser(f"playwright is not installed: {exc}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def browser_page(chromium_browser, artifacts_dir, request):
    """A fresh page (own context); on test failure saves <test>-failure.png + console log."""
    context = chromium_browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"[{m.type}] {m.text}"))
    page.on("pageerror", lambda e: console.append(f"[pageerror] {e}"))
    page.labkit_console = console  # type: ignore[attr-defined]
    yield page
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        stem = request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
        try:
            page.screenshot(path=str(artifacts_dir / f"{stem}-failure.png"), full_page=True)
        except Exception:
            pass
        (artifacts_dir / f"{stem}-console.log").write_text("\n".join(console))
    context.close()


# =========================================================================== cluster
# Reserved for the distributed-runtime fixtures (session-scoped `cluster2` / `cluster4`),
# added by the engineer who owns labkit.cluster.  Keep harness fixtures above this line.
# ===========================================================================


def _cluster(world_size: int):
    import torch

    import labkit

    torch.set_num_threads(1)  # the caller computes references; leave cores to the ranks
    # replace=False: a test that starts its own Cluster of the same size must not stop
    # the shared pool (nor be stopped by it)
    c = labkit.Cluster(world_size, backend="gloo", device="cpu", replace=False)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def cluster4():
    """A warm 4-rank gloo cluster shared by the tests that need one."""
    yield from _cluster(4)


@pytest.fixture(scope="session")
def cluster2():
    """A warm 2-rank gloo cluster shared by the tests that need one."""
    yield from _cluster(2)


@pytest.fixture(scope="session")
def cluster8():
    """A warm 8-rank gloo cluster for the N-D compositions that need 2x2x2 ranks."""
    yield from _cluster(8)


# =========================================================================== notebooks
@pytest.fixture(scope="module")
def cells(request):
    """The code cells, as stored, of the notebook the test module names as ``NB``."""
    from notebook_outputs import code_cells

    return code_cells(request.module.NB)
