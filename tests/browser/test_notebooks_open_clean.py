"""Opening a notebook in JupyterLab leaves it unmodified: no "unsaved changes" dot on the tab
and no question on closing, before the user has typed or run anything. JupyterLab writes
the kernel's ``language_info`` into the notebook's metadata once the kernel is up; a
notebook stored without it (or with another) is marked modified at once."""
from __future__ import annotations

import pytest

from .helpers import open_notebook

pytestmark = pytest.mark.browser

_JS_DIRTY = "() => Array.from(document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty'))" \
            ".map(t => t.textContent.trim())"


@pytest.mark.parametrize("name", ["10_nd_parallelism.ipynb"])
def test_opening_a_notebook_does_not_modify_it(jupyter_server, browser_page, name):
    page = browser_page
    open_notebook(page, jupyter_server, name)
    page.wait_for_timeout(1500)  # the kernel's info arrives after idle
    assert page.evaluate(_JS_DIRTY) == []
