"""Execute notebooks and store the outputs of their ``# NBVAL_CHECK_OUTPUT`` cells only.

``make test`` runs nbval in lax mode: every cell must run, and a cell marked
``# NBVAL_CHECK_OUTPUT`` must print what the stored notebook says it printed. A marked cell
with no stored output would be checked against nothing, so after editing a notebook, run

    .venv/bin/python tools/store_checked_outputs.py notebooks/NN_topic.ipynb

to execute it and keep the outputs of the marked cells (everything else stays cleared, so
the repository holds no plots or timings). Review the stored text before committing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

MARK = "NBVAL_CHECK_OUTPUT"


def store(path: Path, timeout_s: int = 600) -> int:
    nb = nbformat.read(path, as_version=4)
    # The kernel rewrites language_info with this interpreter's version; the stored one
    # (name and lexer, which JupyterLab needs to highlight a fresh clone) is kept as it was.
    language_info = nb.metadata.get("language_info")
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    kept = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)  # run timestamps: noise in every diff
        if MARK in cell.source:
            cell.outputs = [o for o in cell.outputs if o.get("output_type") == "stream"]
            kept += 1
        else:
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("language_info", None)
    if language_info is not None:
        nb.metadata["language_info"] = language_info
    nbformat.write(nb, path)
    return kept


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: stored outputs of {store(Path(arg))} checked cell(s)")
