"""Tensor and sequence parallelism (Megatron-LM), written on :mod:`labkit.comm`.

Shoeybi et al. 2019 (Megatron-LM, §3) split each transformer block's matmuls over ``T``
ranks: column-parallel then row-parallel, with one all-reduce forward and one backward per
attention and per MLP (claims C24, C25). Korthikanti et al. 2022 (§4.2.2) add sequence
parallelism: norms run on ``S/T`` tokens and an all-gather / reduce-scatter pair replaces
each all-reduce at equal volume (C26), which with selective recomputation brings activation
memory per layer to ``34·S·B·H/T`` (C18).

=======================  ================================================================
module                   concept
=======================  ================================================================
``functions``            the conjugate communication operators (``f``, ``g`` and the SP pair)
``layers``               column/row-parallel linears, the (sequence-parallel) RMSNorm
``attention``            parallel attention (grouped-query K/V split or replicated), SwiGLU
``vocab``                vocab-parallel embedding and head, vocabulary padding
``cross_entropy``        vocab-parallel cross-entropy (never gathers logits)
``convert``              :func:`apply_tensor_parallel`, :func:`gather_full`
``check``                :func:`check_tensor_parallel` (before any rank starts)
``measure``              bytes per layer from the trace vs. the formulas; state bytes; C33
``activations``          activation memory per layer, measured vs. C18 adjusted to this model
``torch_tp``             the same layout with PyTorch's ``parallelize_module`` (reference)
=======================  ================================================================
"""
from .check import check_tensor_parallel
from .convert import TensorParallelInfo, apply_tensor_parallel, gather_full
from .cross_entropy import VocabParallelLoss, vocab_parallel_cross_entropy
from .functions import (AllGatherFwdReduceScatterBwd, AllReduceFwdIdentityBwd,
                        IdentityFwdAllReduceBwd, ReduceScatterFwdAllGatherBwd)
from .layers import ColumnParallelLinear, ParallelRMSNorm, RowParallelLinear
from .attention import ParallelAttention, ParallelSwiGLU
from .vocab import VocabParallelEmbedding, VocabParallelHead, padded_vocab

__all__ = ["check_tensor_parallel", "TensorParallelInfo", "apply_tensor_parallel",
           "gather_full", "VocabParallelLoss", "vocab_parallel_cross_entropy",
           "IdentityFwdAllReduceBwd", "AllReduceFwdIdentityBwd", "AllGatherFwdReduceScatterBwd",
           "ReduceScatterFwdAllGatherBwd", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelRMSNorm", "ParallelAttention", "ParallelSwiGLU", "VocabParallelEmbedding",
           "VocabParallelHead", "padded_vocab"]
