"""``labkit run --pp P``: the pipeline flags and their config, checked before any process.

``labkit run --pp 4 --microbatches 8 --schedule 1f1b --steps 3 --model tiny`` runs
:func:`labkit.parallel.pipeline.lab.pipeline_train_mfu` (the executor plus FLOPs and MFU)
on ``P`` ranks and prints the bubble measured from the trace beside the simulator, memory
and MFU per rank (:func:`labkit.cli_report.render_pipeline`). Schedules: ``gpipe``,
``1f1b``, ``interleaved`` (``--virtual-stages V``, default 2), ``zb-h1``, ``zb-v`` (the
V-shaped zero-bubble schedule, two stages per rank). A model shallower than ``P · V``
stages is deepened to one layer per stage (the header says so); ``--n-layers`` fixes the
depth instead. Only the (torch-free) config modules load here.
"""
from __future__ import annotations

__all__ = ["add_arguments", "wants_pipeline", "pipeline_config", "DEFAULT_MICROBATCHES"]

DEFAULT_MICROBATCHES = 4
_ONLY_WITH_PP = (("microbatches", "--microbatches"), ("schedule", "--schedule"),
                 ("virtual_stages", "--virtual-stages"), ("n_layers", "--n-layers"))


def add_arguments(parser) -> None:
    """Add ``--pp``, ``--microbatches``, ``--schedule``, ``--virtual-stages`` and
    ``--n-layers`` to the ``run`` sub-parser."""
    from .parallel.pipeline.schedules import SCHEDULES

    g = parser.add_argument_group("pipeline parallelism")
    g.add_argument("--pp", type=int, default=None, metavar="P",
                   help="pipeline ranks: run the pipeline executor on P ranks (WORLD_SIZE "
                   "under torchrun) and print its bubble, memory and MFU per rank")
    g.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help=f"microbatches per flush (default {DEFAULT_MICROBATCHES}); "
                   "--global-batch must split into them")
    g.add_argument("--schedule", default=None, metavar="NAME",
                   help=f"{', '.join(SCHEDULES)} (default 1f1b; zb-v is the V-shaped "
                   "zero-bubble schedule)")
    g.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="stages per rank for interleaved (default 2)")
    g.add_argument("--n-layers", type=int, default=None, metavar="L",
                   help="model depth (default: the preset's, raised to P x V if shallower)")


def wants_pipeline(args) -> bool:
    """True when the arguments ask for a pipeline run (``--pp`` or a pipeline-only flag)."""
    return args.pp is not None or any(getattr(args, k) is not None for k, _ in _ONLY_WITH_PP)


def pipeline_config(args, world_size=None):
    """The validated :class:`~labkit.parallel.pipeline.config.PipelineConfig` for ``args``.

    Raises:
        ValueError: naming the numbers — a pipeline flag without ``--pp``; ``--pp`` with
            ``--dp > 1``, ``--zero`` or HSDP (N-D composition is not available yet) or with
            a data-parallel-only flag; or what ``PipelineConfig.validate`` rejects (batch
            not splitting into M, more stages than layers, V not dividing the layers per
            rank, an unknown schedule, ``pp`` above ``world_size``).
    """
    from .parallel.pipeline.lab import lab_config

    if args.pp is None:
        flags = [f for k, f in _ONLY_WITH_PP if getattr(args, k) is not None]
        verb = "configures" if len(flags) == 1 else "configure"
        raise ValueError(f"{', '.join(flags)} {verb} pipeline parallelism: add --pp P")
    combined = [f"--dp {args.dp}" if args.dp not in (None, 1) else "",
                f"--zero {args.zero}" if args.zero is not None else "",
                f"--hsdp-replicas {args.hsdp_replicas}" if args.hsdp_replicas != 1 else ""]
    combined = [c for c in combined if c]
    if combined:
        raise ValueError(f"N-D composition is not available yet: --pp {args.pp} with "
                         f"{' and '.join(combined)} (pipeline x data parallelism / ZeRO); "
                         f"run --pp alone (dp=1, no ZeRO)")
    if args.micro_batch is not None:
        raise ValueError(f"--micro-batch {args.micro_batch} is for data parallelism; with "
                         f"--pp the microbatch is --global-batch / --microbatches")
    if args.dp_mode != "ddp":
        raise ValueError(f"--dp-mode {args.dp_mode} is for data parallelism, not --pp")
    if args.bucket_mb != 25.0:
        raise ValueError(f"--bucket-mb {args.bucket_mb:g} sizes data-parallel gradient "
                         f"buckets; a --pp run has none")
    if not args.prefetch:
        raise ValueError("--no-prefetch is for ZeRO-3's all-gathers; a --pp run has none")
    m = DEFAULT_MICROBATCHES if args.microbatches is None else args.microbatches
    cfg = lab_config(args.model, pp=args.pp, microbatches=m, schedule=args.schedule or "1f1b",
                     virtual_stages=args.virtual_stages, n_layers=args.n_layers,
                     global_batch=args.global_batch, steps=args.steps, seed=args.seed,
                     lr=args.lr)
    return cfg.validate(world_size)
