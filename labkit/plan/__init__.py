"""Analytic planning at cluster scale: pure functions of sizes and counts, no torch needed.

* :mod:`labkit.plan.memory` — model-state bytes per rank under DP and ZeRO-1/2/3 (claims
  C10–C12).
* :mod:`labkit.plan.comm` — bytes each rank sends in ring collectives, nccl-tests' bus
  bandwidth factor, and a data-parallel step's traffic (claims C6, C9, C13–C15).
"""
from labkit.plan.comm import (COLLECTIVES, busbw_factor, comm_bytes, dp_step_comm_bytes,
                              normalize_collective)
from labkit.plan.memory import (BYTES_PER_PARAM, model_state_bytes, sharded_state_bytes,
                                GB, GiB)

__all__ = ["COLLECTIVES", "busbw_factor", "comm_bytes", "dp_step_comm_bytes",
           "normalize_collective", "BYTES_PER_PARAM", "model_state_bytes",
           "sharded_state_bytes", "GB", "GiB"]
