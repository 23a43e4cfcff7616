"""The pipeline rules of :func:`labkit.validate.validate_run` (its rule 5, schedules): a
known schedule, microbatches per flush that divide the step's, the stages per rank each
schedule runs, at least one layer per stage, the schedule's own limits, and PyTorch's
``torch.distributed.pipelining`` schedules' rules for ``impl="torch"``.

Each raises a plain ``ValueError`` naming the field(s) and the numbers.
"""
from __future__ import annotations


def _pipeline(cfg, mc) -> None:
    p = cfg.parallel
    if p.pp == 1:
        return
    from .parallel.pipeline.schedules import SCHEDULES, STAGES_PER_RANK

    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; known schedules: "
                         f"{', '.join(SCHEDULES)}")
    if cfg.accum_steps % cfg.flush_microbatches:
        raise ValueError(f"microbatches={cfg.flush_microbatches} per flush does not divide the "
                         f"{cfg.accum_steps} microbatches of a step (local batch "
                         f"{cfg.local_batch} / micro_batch {cfg.micro})")
    v, layers = cfg.stages_per_rank, mc.n_layers
    need = STAGES_PER_RANK.get(cfg.schedule)
    if need is not None and v != need:
        raise ValueError(f"schedule {cfg.schedule!r} runs {need} stage(s) per rank, got "
                         f"virtual_stages={v}")
    if cfg.n_stages > layers:
        raise ValueError(f"pp x virtual_stages = {p.pp} x {v} = {cfg.n_stages} stages but the "
                         f"model has n_layers={layers}: more stages than layers")
    cfg.build_schedule()  # the schedule's own limits (e.g. interleaved M vs P)
    if cfg.impl == "torch":
        _torch_schedule_rules(cfg)


TORCH_SCHEDULE_CLASS = {"zb-v": "ZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}


def _torch_schedule_rules(cfg) -> None:
    """PyTorch's ``torch.distributed.pipelining`` schedules check these on the ranks; labkit
    checks them before launch (torch 2.13, ``schedules.py``)."""
    p, m = cfg.parallel.pp, cfg.flush_microbatches
    if cfg.schedule not in ("gpipe", "1f1b", "interleaved", "zb-v", "dualpipe-v"):
        raise ValueError(f"impl='torch' runs gpipe, 1f1b, interleaved (Interleaved1F1B), "
                         f"zb-v (ZBVZeroBubble) or dualpipe-v (DualPipeV), got "
                         f"schedule={cfg.schedule!r}")
    if cfg.schedule == "1f1b" and m < p:
        raise ValueError(f"PyTorch's Schedule1F1B needs microbatches >= pp: microbatches={m} "
                         f"< pp={p}")
    if cfg.schedule in ("interleaved", "zb-v"):
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"PyTorch's {cfg.schedule} schedule needs microbatches={m} to be "
                             f"a multiple of max(1, microbatches // pp) = {rounds} rounds")
    if cfg.schedule == "zb-v" and cfg.model_config.tie_embeddings:
        raise ValueError("impl='torch' with schedule='zb-v' and tie_embeddings=True: the V "
                         "places the embedding and the head on rank 0, and PyTorch's "
                         "ZBVZeroBubble gets that shared weight's gradient wrong; untie the "
                         "model (ModelConfig(tie_embeddings=False)) or use impl='labkit'")
    if cfg.schedule in ("zb-v", "dualpipe-v") and cfg.measure_memory:
        # found by the composition matrix (tests/oracle): every rank raised
        cls = TORCH_SCHEDULE_CLASS[cfg.schedule]
        raise ValueError(f"impl='torch' with schedule={cfg.schedule!r} and measure_memory=True: "
                         f"under torch's MemTracker (the memory-tracked step) {cls}'s "
                         "input-gradient pass (autograd.grad on a stage input) fails on every "
                         "rank; set measure_memory=False or use impl='labkit'")
    if cfg.flushes != 1:
        raise ValueError(f"impl='torch' runs one pipeline flush per step, got "
                         f"{cfg.flushes} flushes ({cfg.accum_steps} microbatches of a step / "
                         f"microbatches={cfg.flush_microbatches})")
