"""The bottom of the mesh views' import order: what every mesh drawing shares.

:mod:`~labkit_widgets.mesh_view` (the grid), :mod:`~labkit_widgets.mesh_svg` (its SVG
markup), :mod:`~labkit_widgets.mesh_summary` (a planned layout's numbers) and
:mod:`~labkit_widgets.mesh_planned` (a planned layout's drawing) import from here, and this
module imports none of them, so their imports run one way::

    mesh_roles  <-  mesh_svg, mesh_summary  <-  mesh_planned  <-  mesh_view

(tests/test_widget_imports.py checks that ``widgets/`` has no import cycle.)
"""
from __future__ import annotations

__all__ = ["AXIS_ROLE", "AXES4", "PALETTE"]

#: which activation axis each parallelism splits (claim C7)
AXIS_ROLE = {"pp": "layers", "dp": "batch", "cp": "sequence", "tp": "channels"}
#: the rank coordinates' order (Llama 3, Dubey et al. 2024 §3.3.2; claim C36)
AXES4 = ("tp", "cp", "pp", "dp")
#: one colour per group (Vega's tableau10), cycled for more groups
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
           "#FF9DA6", "#9D755D", "#BAB0AC")
