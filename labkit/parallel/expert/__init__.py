"""Expert parallelism: the experts of each MoE layer split over the ranks of the ``ep`` view,
tokens routed to them and back by all-to-all (claim C37).

* :mod:`.dispatch` — :class:`AllToAllV` and the token dispatcher.
* :mod:`.apply` — :func:`apply_expert_parallel` (in place, on a GPT or pipeline stage),
  :func:`expert_parameters`, :func:`gather_full_state`, :func:`check_expert_parallel`.
* :mod:`.measure` — imbalance and the all-to-all bytes formula from the routed counts.
* :mod:`.jobs` — a standalone EP × DP training job and its single-process reference.
"""
from .apply import (ExpertParallelInfo, apply_expert_parallel, check_expert_parallel,
                    expert_param_bytes, expert_parameters, gather_full_state)
from .dispatch import AllToAllV, ExpertParallelDispatcher
from .measure import a2a_bytes_formula, a2a_bytes_from_trace, imbalance, tokens_per_expert

__all__ = ["ExpertParallelInfo", "apply_expert_parallel", "check_expert_parallel",
           "expert_param_bytes", "expert_parameters", "gather_full_state", "AllToAllV",
           "ExpertParallelDispatcher", "a2a_bytes_formula", "a2a_bytes_from_trace",
           "imbalance", "tokens_per_expert"]
