"""An independent single-process reference for the training job (:mod:`oracle.model`: the
model from the papers; :mod:`oracle.run`: training, gradients and FLOPs), and the
compositions the matrix runs through it (:mod:`oracle.matrix`)."""
from .run import initial_params, reference_flops, reference_run, token_groups

__all__ = ["initial_params", "reference_flops", "reference_run", "token_groups"]
