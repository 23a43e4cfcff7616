"""Pipeline parallelism: schedules as data, a pure simulator, and an executor.

* :mod:`.actions`, :mod:`.schedules` — GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and
  DualPipeV as per-rank action lists (``1F0``, ``2B3``, ``0W1``);
* :mod:`.simulate` — costs → makespan, idle, bubble (both definitions), in-flight
  activations; names a deadlock or a bad order;
* :mod:`.stage`, :mod:`.executor` — the real GPT cut into stages, run by any schedule with
  activations and gradients moving through :mod:`labkit.comm`;
* :mod:`.bubble` — bubble, per-rank idle and MFU ceiling measured from a run's trace,
  beside the simulator fed the measured costs, rung by rung; :mod:`.machine` the terms a
  CPU machine adds (shared cores, the executor's time per action);
* :mod:`.report` — the per-rank pipeline report of a run of the one training job
  (:func:`labkit.jobs.train` with ``pp > 1``: :mod:`labkit.train.pipeline` builds the
  executor, or PyTorch's schedule for ``impl="torch"``);
* :mod:`.presets` — ``PP_TINY`` and ``PP_BALANCED``, models deep enough for 8 stages.

Importing this package does not import torch (the executor does, when imported).
"""
from .actions import Action, Schedule
from .bubble import BubbleReport, measure_bubble
from .presets import PP_BALANCED, PP_TINY
from .schedules import SCHEDULES, build, with_comms
from .simulate import ScheduleError, SimResult, simulate

__all__ = ["Action", "Schedule", "SCHEDULES", "build", "with_comms", "simulate", "SimResult",
           "ScheduleError", "PP_TINY", "PP_BALANCED", "measure_bubble", "BubbleReport"]
