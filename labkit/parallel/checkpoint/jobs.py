"""Activation memory per layer (measured beside the formula) and a checkpoint-policy training job.

**Per-layer activations (claim C18).** Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4.1, count the bytes one GPT-2-style layer keeps for
backward (fp16 activations = 2 bytes, dropout masks = 1 byte; LayerNorm, GeLU MLP of width 4H,
dropout, explicit softmax): ``S·B·H·(34 + 5·A·S/H)`` — the CS336 lecture 7 formula. labkit's
block differs term by term (:data:`TERMS`, fp32 = 4 bytes, MHA ``K·D = H``):

=======================  ==========================  ========================================
term                     GPT-2 block (bytes)         labkit block (bytes)
=======================  ==========================  ========================================
2 norms                  ``4SBH`` (LN inputs)        ``8SBH + 8SB``: RMSNorm input, fp32
                                                     ``1/rms`` (the normalised input is
                                                     rebuilt in backward)
QKV input                ``2SBH``                    ``4SBH``
Q, K for ``QKᵀ``         ``4SBH``                    ``4SBH + 4SB·KD`` (after RoPE; rotating
                                                     by a constant table saves nothing more)
softmax, its dropout     ``2AS²B + AS²B + 2AS²B``    SDPA (flash on CPU): output ``4SBH`` +
mask and output                                      log-sum-exp ``4ASB``; no ``S²`` term, no
                                                     dropout. ``attention="math"``: softmax
                                                     output ``4AS²B`` + causal mask ``S²``
V                        ``2SBH``                    ``4SB·KD`` (with GQA the kernel reads
                                                     each K/V head for its group: ``KD ≤ H``)
out-projection input     ``2SBH``                    0 with SDPA (a view of its saved
                                                     output); ``4SBH`` with ``"math"``
attention dropout mask   ``SBH``                     0 (no dropout)
MLP input                ``2SBH``                    ``4SBH`` (shared by ``w1``, ``w3``)
GeLU in / out (4H wide)  ``8SBH + 8SBH``             SwiGLU (``F`` wide): ``w1·x``, ``w3·x``,
                                                     ``silu(w1·x)``, their product: ``16SBF``
MLP dropout mask         ``SBH``                     0
=======================  ==========================  ========================================

Adjusted formula (SDPA): ``4·S·B·(6H + 2KD + 4F + A + 2)`` bytes, ``4·S·B·(8H + 4F + A + 2)``
with ``KD = H``; with
``attention="math"`` the log-sum-exp gives way to the softmax and the projection keeps its
own input: ``4SB(8H + 4F + 2) + 4AS²B + S²``.
:func:`measure_layer_activations` measures it with saved-tensor hooks.

**The job.** :func:`train_policy` trains the GPT under a checkpoint policy and reports step
time, activation bytes, and MFU beside HFU: hardware FLOPs are counted by torch's FLOP counter
on a step *with* the policy (recomputation included), model FLOPs on one without.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...config import ModelConfig, preset
from ...measure.flops import count_flops
from ...measure.mfu import mfu as mfu_report
from ...measure.rank_peak import rank_peak_flops
from ...measure.peak import device_peak_flops
from ...models import build_model
from ...models.data import text_batch
from ...models.gpt import GPT, Block, rope_tables
from ...trace import region
from .exec import SavedTensorTracker
from .policy import POLICIES, apply_checkpoint_policy

__all__ = ["TERMS", "korthikanti_layer_bytes", "adjusted_layer_bytes", "layer_terms",
           "measure_layer_activations", "LiveActivations", "CheckpointRunConfig",
           "measure_policy", "train_policy"]

#: (term, GPT-2 block, labkit block) as text, the rows of the module docstring's table.
TERMS = (("2 norms", "4SBH", "8SBH + 8SB"), ("QKV input", "2SBH", "4SBH"),
         ("Q, K", "4SBH", "4SBH + 4SB·KD"),
         ("softmax + dropout", "5AS²B", "4SBH + 4ASB (SDPA) | 4AS²B + S² (math)"),
         ("V", "2SBH", "4SB·KD"), ("out-proj input", "2SBH", "0 (SDPA) | 4SBH (math)"),
         ("attn dropout mask", "SBH", "0"), ("MLP input", "2SBH", "4SBH"),
         ("GeLU in/out | SwiGLU", "16SBH", "16SBF"), ("MLP dropout mask", "SBH", "0"))


def korthikanti_layer_bytes(seq: int, batch: int, hidden: int, heads: int) -> float:
    """``S·B·H·(34 + 5·A·S/H)`` bytes (Korthikanti et al. 2022, eq. 1; CS336 lecture 7)."""
    return seq * batch * hidden * (34 + 5 * heads * seq / hidden)


def layer_terms(cfg: ModelConfig, batch: int, seq: Optional[int] = None,
                attention: str = "sdpa") -> dict[str, int]:
    """labkit's block, term by term, in bytes (fp32) — the right column of :data:`TERMS`."""
    s, b, h, a = seq or cfg.seq_len, batch, cfg.d_model, cfg.n_heads
    f, sb, kd = cfg.ffn_dim, s * batch, cfg.kv_heads * cfg.head_dim
    sdpa = attention == "sdpa"
    core = 4 * sb * h + 4 * a * sb if sdpa else 4 * a * s * s * b + s * s
    return {"2 norms": 8 * sb * h + 8 * sb, "QKV input": 4 * sb * h, "Q, K": 4 * sb * (h + kd),
            "softmax + dropout": core, "V": 4 * sb * kd,
            "out-proj input": 0 if sdpa else 4 * sb * h,
            "attn dropout mask": 0, "MLP input": 4 * sb * h, "GeLU in/out | SwiGLU": 16 * sb * f,
            "MLP dropout mask": 0}


def adjusted_layer_bytes(cfg: ModelConfig, batch: int, seq: Optional[int] = None,
                         attention: str = "sdpa") -> int:
    """Sum of :func:`layer_terms`: ``4SB(6H + 2KD + 4F + A + 2)`` bytes for SDPA."""
    return sum(layer_terms(cfg, batch, seq, attention).values())


def measure_layer_activations(cfg: ModelConfig, batch: int, seq: Optional[int] = None,
                              attention: str = "sdpa", in_model: bool = True) -> int:
    """Bytes one transformer block saves for backward, from saved-tensor hooks (fp32, CPU).

    ``in_model=True`` runs whole GPTs with ``L`` and ``1`` layers on the same tokens and
    returns the difference over ``L − 1`` (``cfg.n_layers >= 2``); otherwise one ``Block`` on
    random ``(B, S, H)`` input. One count per storage; parameters and buffers excluded.
    """
    s = seq or cfg.seq_len
    if in_model and cfg.n_layers >= 2:
        idx = torch.randint(0, cfg.vocab_size, (batch, s), generator=torch.Generator()
                            .manual_seed(0))
        saved = []
        for n in (cfg.n_layers, 1):
            model = GPT(dataclasses.replace(cfg, n_layers=n), attention=attention)
            tr = SavedTensorTracker(exclude=[model])
            with tr.hooks():
                out = model(idx)
            saved.append(tr.current)
            del out
        return (saved[0] - saved[1]) // (cfg.n_layers - 1)
    block = Block(cfg, attention=attention)
    rope = rope_tables(s, cfg.head_dim, cfg.rope_theta)
    tr = SavedTensorTracker(exclude=[block, *rope])
    x = torch.randn(batch, s, cfg.d_model, requires_grad=True)
    with tr.hooks():
        out = block(x, rope)
    del out
    return tr.peak


class LiveActivations(TorchDispatchMode):
    """Bytes of the tensors created with grad enabled (forward and recomputation; gradients and
    the optimizer run without grad) that are still alive; ``peak`` over the whole span.

    Unlike saved-tensor hooks this also sees what selective checkpointing caches itself.
    ``mark(label)`` stores ``current`` in ``marks``.
    """

    def __init__(self, exclude: torch.nn.Module):
        super().__init__()
        self._excluded = {t.untyped_storage().data_ptr()
                          for t in list(exclude.parameters()) + list(exclude.buffers())}
        self._live: dict = {}
        self.current = self.peak = 0
        self.marks: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    if ptr not in self._live and ptr not in self._excluded and st.nbytes():
                        self._live[ptr] = st.nbytes()
                        self.current += st.nbytes()
                        self.peak = max(self.peak, self.current)
                        weakref.finalize(st, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.current -= self._live.pop(ptr, 0)

    def mark(self, label: str) -> None:
        self.marks[label] = self.current


@dataclass(frozen=True)
class CheckpointRunConfig:
    """One policy run: model (preset name or config), policy, ``every`` (C), micro-batch
    (sequences per step), steps (the first is warm-up; the last is measured for memory)."""

    model: Union[ModelConfig, str] = "tiny"
    policy: str = "none"
    every: int = 1
    micro_batch: int = 8
    steps: int = 4
    seed: int = 0
    lr: float = 1e-3
    count_flops: bool = True

    @property
    def model_config(self) -> ModelConfig:
        return preset(self.model) if isinstance(self.model, str) else self.model

    def validate(self, world_size: Optional[int] = None) -> "CheckpointRunConfig":
        """Raises ``ValueError`` for a bad policy, ``every``, micro-batch or step count (any
        ``world_size``: each rank runs the whole model)."""
        mc = self.model_config
        mc.validate()
        if mc.kind != "gpt":
            raise ValueError(f"checkpoint runs train the GPT, got model kind {mc.kind!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown checkpoint policy {self.policy!r}; known: "
                             f"{', '.join(POLICIES)}")
        if self.policy == "every" and not 1 <= self.every <= mc.n_layers:
            raise ValueError(f"C must satisfy 1 <= C <= N: got C={self.every} with "
                             f"N={mc.n_layers} layers")
        if self.micro_batch < 1 or self.steps < 2:
            raise ValueError(f"need micro_batch >= 1 and steps >= 2, got {self.micro_batch}, "
                             f"{self.steps}")
        return self


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_policy(cfg: CheckpointRunConfig, device="cpu",
                   peak_flops: Optional[float] = None) -> dict:
    """Train ``cfg`` in this process; returns ``{"losses", "metrics"}`` (plain data).

    Metrics: ``step_time_s`` (median of the steps after the first, memory step excluded),
    ``activation_bytes`` (stored after the forward) and ``peak_activation_bytes`` (over the
    step, recomputation included) from :class:`LiveActivations`, ``saved_bytes`` (what the
    saved-tensor hooks see after the forward), ``model_flops`` / ``hardware_flops`` per step
    (FLOP counter without / with the policy), ``peak_flops`` (FLOP/s; CPU: calibrated unless
    given), ``mfu`` and ``hfu``.

    Raises:
        ValueError: from :meth:`CheckpointRunConfig.validate`.
    """
    cfg.validate()
    mc = cfg.model_config
    model = apply_checkpoint_policy(build_model(mc, device=device, seed=cfg.seed), cfg.policy,
                                    cfg.every)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def batch(s):
        x, y = text_batch(s, cfg.micro_batch, mc.seq_len, seed=cfg.seed)
        return x.to(device), y.to(device)

    losses, times = [], []
    live = tracker = None
    for s in range(cfg.steps):
        x, y = batch(s)
        measured = s == cfg.steps - 1
        if measured:
            live, tracker = LiveActivations(model), SavedTensorTracker(exclude=[model])
            live.__enter__()
        _sync(device)
        t0 = time.perf_counter()
        try:
            with region("forward"):
                if tracker is not None and measured:
                    with tracker.hooks():
                        loss = model(x, y)
                    live.mark("forward")
                else:
                    loss = model(x, y)
            with region("backward"):
                loss.backward()
            with region("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            _sync(device)
        finally:
            if measured:
                live.__exit__(None, None, None)
        if not measured or cfg.steps == 2:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_time = statistics.median(times[1:] or times)
    m = {"policy": cfg.policy, "every": cfg.every, "micro_batch": cfg.micro_batch,
         "model": mc.name, "n_layers": mc.n_layers, "tokens_per_step": cfg.micro_batch * mc.seq_len,
         "step_time_s": step_time, "step_times": times,
         "activation_bytes": live.marks["forward"], "peak_activation_bytes": live.peak,
         "saved_bytes": tracker.peak, "model_flops": None, "hardware_flops": None,
         "peak_flops": peak_flops, "mfu": None, "hfu": None}
    if cfg.count_flops:
        x, y = batch(0)
        for key, policy in (("model_flops", "none"), ("hardware_flops", cfg.policy)):
            ref = apply_checkpoint_policy(build_model(mc, device=device, seed=cfg.seed),
                                          policy, cfg.every)
            m[key] = float(count_flops(lambda: ref(x, y).backward()).total)
        if peak_flops is None:
            peak_flops = device_peak_flops(device, torch.float32)
        m["peak_flops"] = peak_flops
        if peak_flops:
            rep = mfu_report(m["model_flops"], step_time, peak_flops, 1, m["hardware_flops"])
            m["mfu"], m["hfu"] = rep.mfu, rep.hfu
    return {"losses": losses, "metrics": m}


def train_policy(ctx, cfg: CheckpointRunConfig) -> dict:
    """Cluster job: every rank runs :func:`measure_policy` on its own (no communication), with
    the CPU peak calibrated while all ranks run the matmul loop (as :mod:`labkit.train` does)."""
    out = measure_policy(cfg, ctx.device, peak_flops=rank_peak_flops(ctx, torch.float32))
    out["metrics"]["rank"] = ctx.rank
    return out
