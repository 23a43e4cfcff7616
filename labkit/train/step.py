"""One optimizer step of the training job: microbatches (or pipeline flushes), gradient
synchronisation over the data ranks, the optimizer.

    data → (forward → backward) × microbatches  |  pipeline flushes
         → tied-embedding sum (pipeline) → data-parallel reduction → AdamW

Each phase is a traced region (``data``, ``forward``/``backward`` per microbatch or the
pipeline executor's ``F``/``B``/``W``/``BW`` spans, ``grad_sync``, ``optimizer``,
``param_sync``). Every microbatch's loss is ``Σ token losses / tokens_per_step``: the
gradient summed over all ranks is then the gradient of the global mean loss, with no
group-size divisor anywhere (DESIGN.md §9).
"""
from __future__ import annotations

import torch

from ..faults import inject
from ..faults.sdc import ReplicaCheck, flip_and_check
from ..trace import region
from .build import RankSetup
from .data import rank_batch, tokens_per_sample

__all__ = ["make_step", "grad_scale"]


def grad_scale(setup: RankSetup) -> float:
    """What each microbatch's token-loss sum is multiplied by before backward:
    ``1 / tokens_per_step``. labkit's wrappers then sum over the data ranks; PyTorch's DDP
    and FSDP2 average, so for them it is multiplied by the data ranks, which their
    reduction divides out again."""
    cfg = setup.cfg
    n = setup.mg.size("dp_cp") if cfg.impl == "torch" else 1
    return n / (cfg.global_batch * tokens_per_sample(cfg))


def _loss_sum(stage, out, y):
    """Σ token losses of one microbatch (fp32)."""
    if hasattr(stage, "loss"):
        return stage.loss(out, y, "sum")
    return torch.nn.functional.cross_entropy(out.float(), y, reduction="sum")  # the ViT


def make_step(setup: RankSetup, executor=None, on_synced=None, noise=None):
    """``step(s, mark) -> loss`` for :func:`labkit.train.run_steps`: this rank's share of
    step ``s``'s global mean loss (Σ its token losses / tokens_per_step; 0.0 on ranks
    without the last pipeline stage), a 0-d float64 tensor on the rank's device (read
    after the step, so the host never waits inside it). ``on_synced(s)`` runs after the
    gradient reduction, before the optimizer (to read the reduced gradients). ``noise``: a
    :class:`~labkit.train.noise_scale.NoiseScaleMeter` reading the local gradients just
    before the reduction and the reduced ones just after."""
    cfg, mg = setup.cfg, setup.mg
    dp_index, cp_index = mg.index("dp"), mg.index("cp")
    scale = grad_scale(setup)
    micro, accum = cfg.micro, cfg.accum_steps
    # silent-data-corruption checks and bit flips (labkit.faults): replicated parameters only
    replicas = [p for _, p in setup.wrappers[0].params] \
        if setup.wrappers and hasattr(setup.wrappers[0], "params") else []
    check = ReplicaCheck(setup.wrappers, cfg.fingerprint_every, mg.rank) \
        if cfg.fingerprint_every else None

    def sync(measure: bool = False) -> None:
        if setup.tied is not None:
            setup.tied.sync()
        if measure and noise is not None:
            noise.before_sync()
        if setup.wrappers:
            with region("grad_sync"):
                for w in setup.wrappers:
                    if hasattr(w, "finish_gradient_sync"):
                        w.finish_gradient_sync()
        if measure and noise is not None:
            noise.after_sync()

    def zero_grads() -> None:
        for m in setup.stages.values():
            for p in m.parameters():
                p.grad = None

    def finish(s: int, mark, compute=None) -> None:
        sync(measure=True)  # a re-run for the replica check is not measured again
        if replicas and (check is not None or inject.armed()):
            with region("fingerprint"):
                flip_and_check(check, s, replicas, lambda: (compute(s), sync()), zero_grads)
        if on_synced is not None:
            on_synced(s)
        mark("backward")
        with region("optimizer"):
            setup.opt.step()
        if setup.sharded:
            with region("param_sync"):
                for w in setup.sharded:
                    w.after_step()
        if replicas and inject.armed():
            inject.flip(s, "param", replicas)
        if check is not None and check.due(s):
            with region("fingerprint"):
                check.check_params(s)
        mark("optimizer")
        for w in setup.sharded:  # stages 2-3 keep their persistent gradient shards
            w.zero_grad()
        for p in setup.plain_params:
            p.grad = None

    def compute(s: int, mark=lambda label: None) -> torch.Tensor:
        x, y = rank_batch(cfg, s, dp_index, setup.device, cp_index)
        stage, fwd = setup.stages[0], setup.forward[0]
        # the sum stays on the device: reading it here (``.item()``) would make the host wait
        # for every queued kernel once per microbatch on a GPU (tests/test_device_placement.py)
        total = torch.zeros((), dtype=torch.float64, device=setup.device)
        for m in range(accum):
            setup.require_sync(m == accum - 1)
            xs, ys = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
            with region("forward", micro=m):
                with setup.autocast():
                    loss_sum = _loss_sum(stage, fwd(xs), ys)
                loss = loss_sum * scale
            mark(f"forward {m}")
            with region("backward", micro=m):
                loss.backward()
            total += loss_sum.detach().double()
        return total

    def step_plain(s: int, mark) -> torch.Tensor:
        total = compute(s, mark)
        finish(s, mark, compute)
        return total / (cfg.global_batch * tokens_per_sample(cfg))

    def step_pipeline(s: int, mark) -> torch.Tensor:
        x, y = rank_batch(cfg, s, dp_index, setup.device, cp_index)
        per_flush = cfg.flush_microbatches * micro
        setup.require_sync(False)  # reduce once, after the last flush
        total = torch.zeros((), dtype=torch.float64, device=setup.device)
        with setup.autocast():
            for f in range(cfg.flushes):
                sl = slice(f * per_flush, (f + 1) * per_flush)
                total += executor.run(x[sl], y[sl], scale, f).to(total.device)
        mark("flushes")
        finish(s, mark)
        return total / (scale * cfg.global_batch * tokens_per_sample(cfg))

    step = step_pipeline if executor is not None else step_plain
    step.sdc = check  # the fingerprint's record, for the run's metrics
    return step
