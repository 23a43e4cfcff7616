"""Browser (Playwright + headless Chromium) tests of JupyterLab notebooks."""
