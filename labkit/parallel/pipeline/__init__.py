"""Pipeline parallelism: schedules as data, a pure simulator, and an executor.

* :mod:`.actions`, :mod:`.schedules` — GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V as
  per-rank action lists (``1F0``, ``2B3``, ``0W1``);
* :mod:`.simulate` — costs → makespan, idle, bubble (both definitions), in-flight
  activations; names a deadlock or a bad order;
* :mod:`.stage`, :mod:`.executor` — the real GPT cut into stages, run by any schedule with
  activations and gradients moving through :mod:`labkit.comm`;
* :mod:`.jobs` — ``pipeline_train`` (the cluster job), ``torch_pipeline_train``
  (``torch.distributed.pipelining``, for parity and speed) and ``reference`` (one process);
* :mod:`.bubble` — bubble, per-rank idle and MFU ceiling measured from a run's trace,
  beside the simulator fed the measured costs, rung by rung.
* :mod:`.lab` — what ``labkit run --pp`` and the explorer run and show: a config deep
  enough for its stages, ``pipeline_train`` plus FLOPs and MFU, the per-rank report.

Importing this package does not import torch (the executor and jobs do, when imported).
"""
from .actions import Action, Schedule
from .bubble import BubbleReport, measure_bubble
from .config import PipelineConfig
from .presets import PP_BALANCED, PP_TINY
from .schedules import SCHEDULES, build, with_comms
from .simulate import ScheduleError, SimResult, simulate

__all__ = ["Action", "Schedule", "SCHEDULES", "build", "with_comms", "simulate", "SimResult",
           "ScheduleError", "PipelineConfig", "PP_TINY", "PP_BALANCED", "measure_bubble", "BubbleReport"]
