"""Expert parallelism: the experts of each MoE layer split over the ranks of the ``ep`` view,
tokens routed to them and back by all-to-all (claim C37).

* :mod:`.dispatch` — :class:`AllToAllV` and the token dispatcher.
* :mod:`.apply` — :func:`apply_expert_parallel` (in place, on a GPT or pipeline stage),
  :func:`expert_parameters`, :func:`gather_full_state`, :func:`check_expert_parallel`.
* :mod:`.measure` — imbalance, the all-to-all bytes formula from the routed counts, and
  what a training run's trace should hold by that formula.

The training job :func:`labkit.train.run` composes them (``RunConfig(parallel=dict(ep=...))``);
:func:`labkit.train.reference` is its single-process ground truth.
"""
from .apply import (ExpertParallelInfo, apply_expert_parallel, check_expert_parallel,
                    expert_param_bytes, expert_parameters, gather_full_state)
from .dispatch import AllToAllV, ExpertParallelDispatcher
from .measure import (a2a_bytes_expected, a2a_bytes_formula, a2a_bytes_from_trace,
                      expert_numel, imbalance, tokens_per_expert)

__all__ = ["ExpertParallelInfo", "apply_expert_parallel", "check_expert_parallel",
           "expert_param_bytes", "expert_parameters", "gather_full_state", "AllToAllV",
           "ExpertParallelDispatcher", "a2a_bytes_expected", "a2a_bytes_formula",
           "a2a_bytes_from_trace", "expert_numel", "imbalance", "tokens_per_expert"]
