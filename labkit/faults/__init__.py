"""Faults: inject them, detect them, recover, and count what they cost.

* :mod:`.spec` — :class:`FaultSpec` (``"kill@3:rank1"``) and its checks before launch;
* :mod:`.inject` — the rank side: kill, hang, stall, skip, slow, bit flip at the step named;
* :mod:`.recorder` — labkit's flight recorder (every collective entered and left, a
  heartbeat per rank);
* :mod:`.diagnose` — which rank hung where: a missing member, or a stall inside the
  backend (every member entered; who is frozen);
* :mod:`.straggler` — slow ranks, from a run's trace and live from the flight records;
* :mod:`.sdc` — the cross-replica fingerprint that catches silent data corruption;
* :mod:`.goodput` — Young/Daly's checkpoint interval and expected goodput (Llama 3's
  interruption figures as the worked example);
* :mod:`.recover` — :func:`run_resilient`: run, detect, restart the pool, run again.
"""
from .spec import KINDS, FaultSpec, check_faults, parse_faults

__all__ = ["FaultSpec", "KINDS", "parse_faults", "check_faults"]
