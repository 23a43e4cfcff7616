"""A standalone expert-parallel training job (EP × data parallelism) and its reference.

``train`` runs ``ExpertRunConfig`` on ``data_ranks`` ranks: each rank takes its rows of the
global batch, the experts are split over ``ep``-rank blocks of them (``labkit.mesh``'s
``ep`` view), and after backward the dense gradients are summed over all data ranks and the
expert gradients over the expert-data group (the ranks holding the same experts). The loss
is the one training job's rule: each rank's summed token losses over the global token count,
and the aux loss scaled by the rank's share of the tokens. ``reference`` is the same training
in one process, with the token groups set to the data ranks, so it is exactly comparable.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ... import comm
from ...config import ModelConfig, ParallelConfig, check_optimizer_and_timeout, preset
from ...measure.memory import measure_memory
from ...mesh import Mesh
from ...models import build_model
from ...models.data import text_batch
from ...models.moe import record_routing, set_aux_loss_scale, set_token_groups
from ...trace import region
from .apply import (apply_expert_parallel, check_expert_parallel, expert_parameters,
                    gather_full_state)

__all__ = ["ExpertRunConfig", "train", "reference"]


@dataclass(frozen=True)
class ExpertRunConfig:
    """An expert-parallel training run.

    Attributes:
        model: a preset name or a :class:`~labkit.config.ModelConfig` with ``n_experts > 0``.
        ep: ranks one layer's experts are split over.
        dp: data ranks (default ``ep``); ``ep`` must divide it.
        steps, global_batch, lr, weight_decay, seed: as in ``RunConfig``.
        optimizer: ``"adamw"`` or ``"sgd"`` (plain SGD keeps gradient-scale errors visible).
        return_state: every rank returns the full parameters after training and the full
            gradients of step 0 (experts gathered over ``ep``).
        measure_memory: run the last step under torch's ``MemTracker``
            (:func:`labkit.measure.memory.measure_memory`).
        timeout_s: seconds before a hung run is cancelled.
    """

    model: ModelConfig | str = "tiny-moe"
    ep: int = 2
    dp: Optional[int] = None
    steps: int = 3
    global_batch: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    optimizer: str = "adamw"
    return_state: bool = False
    measure_memory: bool = False
    timeout_s: float = 120.0

    @property
    def model_config(self) -> ModelConfig:
        return preset(self.model) if isinstance(self.model, str) else self.model

    @property
    def data_ranks(self) -> int:
        return self.dp if self.dp is not None else self.ep

    @property
    def mesh(self) -> Mesh:
        """The ranks as data ranks (``dp_shard``) with the ``ep`` view over them."""
        return Mesh(dp_shard=self.data_ranks, ep=self.ep)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(dp=self.data_ranks)

    def validate(self, world_size: Optional[int] = None) -> "ExpertRunConfig":
        """Raises ``ValueError`` naming the field and the numbers."""
        mc = self.model_config
        mc.validate()
        if not mc.n_experts:
            raise ValueError(f"model {mc.name!r} is dense (n_experts=0); expert parallelism "
                             "needs a mixture-of-experts model such as 'tiny-moe'")
        if isinstance(self.dp, bool) or (self.dp is not None and
                                         (not isinstance(self.dp, int) or self.dp < 1)):
            raise ValueError(f"dp must be None or a positive int, got {self.dp!r}")
        check_expert_parallel(mc, self.ep, self.data_ranks)
        if world_size is not None and self.data_ranks > world_size:
            raise ValueError(f"dp={self.data_ranks} data ranks need {self.data_ranks} ranks, "
                             f"the cluster has world_size={world_size}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.global_batch < 1 or self.global_batch % self.data_ranks:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by "
                             f"dp={self.data_ranks}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        check_optimizer_and_timeout(self)
        return self


def _optimizer(params, cfg: ExpertRunConfig):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _routing_record(log: list) -> dict:
    """Per-layer lists of one step's routing (summed over the forward's groups)."""
    return {"counts": [s.counts.sum(0).tolist() for s in log],
            "kept": [s.kept.sum(0).tolist() for s in log],
            "dropped": [int(s.dropped.shape[0]) for s in log],
            "aux": [float(s.aux) for s in log]}


def train(ctx, cfg: ExpertRunConfig) -> dict:
    """Train on this rank; returns plain data.

    Returns:
        ``{"losses"[s]``: this rank's loss share (the sum over ranks is the global mean),
        ``"routing"[s]``: ``{"counts", "kept"`` (``[layer][expert]`` choices this rank routed
        before / after dropping), ``"dropped"[layer]``, ``"aux"[layer]}``,
        ``"dropped_idx"``: step 0's ``[layer]`` list of ``(token, slot)`` dropped here,
        ``"info"``: :class:`ExpertParallelInfo` as a dict, ``"param_bytes"``, ``"d_model"``,
        ``"elem_bytes"``, with ``return_state`` ``"state"``/``"grads0"`` (full, by name), and
        with ``measure_memory`` ``"memory"``: ``{"peak"`` bytes by category, ``"parameters"``
        the tracked parameter bytes``}``}.
    """
    cfg.validate(ctx.world_size)
    mc = cfg.model_config
    mg = ctx.mesh_groups(cfg.mesh)
    ep_group, dp_group, edp_group = (mg.maybe_group(a) for a in ("ep", "dp_cp", "edp"))
    data_index = mg.index("dp_cp")
    model = build_model(mc, device=ctx.device, seed=cfg.seed)
    info = apply_expert_parallel(model, ep_group)
    rows = cfg.global_batch // cfg.data_ranks
    set_aux_loss_scale(model, 1.0 / cfg.data_ranks)  # this rank's tokens / global tokens
    expert_ids = {id(p) for _, p in expert_parameters(model)}
    params = list(model.parameters())
    opt = _optimizer(params, cfg)
    out: dict = {"losses": [], "routing": []}

    def step(s: int) -> None:
        with region("data"):
            x, y = text_batch(s, cfg.global_batch, mc.seq_len, cfg.seed)
            x = x[data_index * rows:(data_index + 1) * rows].to(ctx.device)
            y = y[data_index * rows:(data_index + 1) * rows].to(ctx.device)
        with record_routing(model) as log:
            with region("forward"):
                logits = model(x)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       y.reshape(-1), reduction="sum")
                loss = loss / (cfg.global_batch * mc.seq_len)
            with region("backward"):
                loss.backward()
        with region("grad_sync"):
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                expert = id(p) in expert_ids
                group = edp_group if expert else dp_group
                if group is not None:
                    comm.all_reduce(p.grad, "sum", group, axis="edp" if expert else "dp_cp")
        if s == 0:
            out["dropped_idx"] = [st.dropped.tolist() for st in log]
            if cfg.return_state:
                out["grads0"] = gather_full_state(model, ep_group, grads=True)
        with region("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["routing"].append(_routing_record(log))

    for s in range(cfg.steps):
        ctx.tracer.step = s
        if cfg.measure_memory and s == cfg.steps - 1:
            report = measure_memory(lambda: step(s), model, opt, ctx.device)
            snaps = [dict(v) for _, v in report.timeline] + [dict(report.peak)]
            out["memory"] = {"peak": dict(report.peak),
                             "parameters": max(v.get("parameters", 0) for v in snaps)}
        else:
            step(s)
    out["info"] = asdict(info)
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
    out["d_model"], out["elem_bytes"] = mc.d_model, params[0].element_size()
    if cfg.return_state:
        out["state"] = gather_full_state(model, ep_group)
    return out


def reference(cfg: ExpertRunConfig, device: str = "cpu") -> dict:
    """The same training in one process: the global batch at once, token groups = the data
    ranks. Returns ``{"losses", "routing", "dropped_idx", "grads0", "state"}`` with
    ``routing[s]["counts"]`` as ``[layer][group][expert]`` and ``dropped_idx`` indices into
    the global batch's flattened tokens."""
    cfg.validate()
    mc = cfg.model_config
    model = build_model(mc, device=device, seed=cfg.seed)
    set_token_groups(model, cfg.data_ranks)
    params = list(model.parameters())
    opt = _optimizer(params, cfg)
    out: dict = {"losses": [], "routing": []}
    for s in range(cfg.steps):
        x, y = text_batch(s, cfg.global_batch, mc.seq_len, cfg.seed)
        with record_routing(model) as log:
            loss = model(x.to(device), y.to(device))
            loss.backward()
        if s == 0:
            out["dropped_idx"] = [st.dropped.tolist() for st in log]
            out["grads0"] = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                             for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["routing"].append({"counts": [st.counts.tolist() for st in log],
                               "kept": [st.kept.tolist() for st in log],
                               "aux": [float(st.aux) for st in log]})
    out["state"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out

