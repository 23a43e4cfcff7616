"""``labkit run``'s flags and the one :class:`~labkit.config.RunConfig` they describe.

Every flag sets exactly one ``RunConfig`` field (:data:`FLAGS` is the table; ``--model``
and ``--n-layers`` both set ``model``). A flag left out keeps the field's default, so the
command line and a notebook's ``RunConfig(...)`` mean the same run. :func:`resolve` turns
the parsed arguments into a validated config before any process starts:

1. the output paths exist up to their last part: ``--trace`` is a file in an existing
   folder, ``--save-dir`` a folder in an existing folder (created if missing);
2. the degrees: on an own cluster ``dp·tp·pp·cp`` ranks are started; under torchrun they
   must multiply to ``WORLD_SIZE`` (``--dp`` left out takes what the others leave), and
   ``--timeout`` (the own cluster's hang guard) is refused;
3. a model shallower than ``pp·V`` stages is deepened to one layer per stage (unless
   ``--n-layers`` fixes the depth);
4. :meth:`RunConfig.validate` (:mod:`labkit.validate`), then, on an own cluster,
   :func:`labkit.preflight.check_run_fits` (ranks per core, model state in memory).

Every failure is a :class:`~.common.UsageError` naming the field and the numbers (plus
the flag, where its name differs from the field's). Only torch-free modules load here.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import NamedTuple, Optional

from ..config import COUNT_ONLY, PRESETS
from .common import UsageError

__all__ = ["Flag", "FLAGS", "NOT_FLAGS", "OUTPUT_FLAGS", "add_run_arguments",
           "config_from_args", "resolve", "Resolved"]

DEGREES = ("dp", "tp", "pp", "cp", "ep")


class Flag(NamedTuple):
    """One ``labkit run`` flag: the ``RunConfig`` field it sets (``parallel.<degree>`` for
    a degree), its value type (``None``: a switch that sets ``const``), and its group."""

    flag: str
    field: str
    type: Optional[type]
    help: str
    group: str
    const: object = None
    metavar: Optional[str] = None
    nargs: Optional[str] = None


_MODEL, _DP, _PP, _ND, _SPEED = ("model and batch", "data parallelism and ZeRO",
                                 "pipeline parallelism",
                                 "tensor, context and expert parallelism",
                                 "activations, precision, implementation")
_FAULTS = "faults (labkit.faults)"
_SNAP = "snapshots of the training state (labkit.snapshot; not activation checkpointing)"

#: every ``labkit run`` flag and the RunConfig field it sets
FLAGS: tuple = (
    Flag("--model", "model", str, "model preset: " + ", ".join(sorted(set(PRESETS) - COUNT_ONLY))
         + " (default tiny; the Llama 3 presets are for `labkit plan`)", _MODEL, metavar="NAME"),
    Flag("--n-layers", "model", int, "model depth (default: the preset's; with --pp a "
         "shallower preset is deepened to one layer per stage)", _MODEL, metavar="L"),
    Flag("--steps", "steps", int, "optimizer steps (default 3)", _MODEL, metavar="N"),
    Flag("--global-batch", "global_batch", int, "samples per step over all ranks "
         "(default 8)", _MODEL, metavar="B"),
    Flag("--micro-batch", "micro_batch", int, "samples per forward/backward on one data "
         "rank (default: the local batch; with --pp, local / microbatches)", _MODEL,
         metavar="b"),
    Flag("--lr", "lr", float, "AdamW learning rate (default 1e-3)", _MODEL),
    Flag("--weight-decay", "weight_decay", float, "AdamW weight decay (default 0)", _MODEL),
    Flag("--adam-eps", "adam_eps", float, "AdamW epsilon (default 1e-8)", _MODEL),
    Flag("--seed", "seed", int, "model initialisation and data order (default 0)", _MODEL),
    Flag("--timeout", "timeout_s", float, "seconds before a hung job is cancelled on the "
         "own cluster (default 120)", _MODEL, metavar="S"),
    Flag("--dp", "parallel.dp", int, "data-parallel ranks (default 1; under torchrun, "
         "WORLD_SIZE / (tp·pp·cp))", _DP, metavar="N"),
    Flag("--zero", "zero_stage", int, "ZeRO stage: 0 DP, 1 optimizer state sharded, "
         "2 + gradients, 3 + parameters = FSDP (default 0)", _DP, metavar="{0,1,2,3}"),
    Flag("--hsdp-replicas", "hsdp_replicas", int, "HSDP: M replica groups of dp/M shards "
         "(ZeRO 1-3; default 1)", _DP, metavar="M"),
    Flag("--no-prefetch", "prefetch", None, "ZeRO-3: do not issue the next unit's "
         "all-gather early", _DP, const=False),
    Flag("--no-keep-last", "keep_last", None, "ZeRO-3: free the root unit after forward "
         "and gather it again in backward", _DP, const=False),
    Flag("--dp-mode", "dp_mode", str, "ZeRO 0: ddp (bucketed, overlapped all-reduce) or "
         "naive (one all-reduce per parameter after backward); PyTorch DDP is --impl torch",
         _DP, metavar="{ddp,naive}"),
    Flag("--bucket-mb", "bucket_mb", float, "ddp gradient bucket size in MiB (default 25)",
         _DP, metavar="MB"),
    Flag("--find-unused", "find_unused", None, "ZeRO 0: all-reduce zeros for parameters "
         "without a gradient instead of failing", _DP, const=True),
    Flag("--pp", "parallel.pp", int, "pipeline ranks (default 1)", _PP, metavar="P"),
    Flag("--schedule", "schedule", str, "gpipe, 1f1b, interleaved, zb-h1, zb-v, "
         "dualpipe-v (default 1f1b)", _PP, metavar="NAME"),
    Flag("--microbatches", "microbatches", int, "microbatches per pipeline flush (default: "
         "all of a step's in one flush)", _PP, metavar="M"),
    Flag("--virtual-stages", "virtual_stages", int, "stages per pipeline rank V (default: "
         "what the schedule needs; interleaved 2)", _PP, metavar="V"),
    Flag("--tp", "parallel.tp", int, "tensor-parallel ranks (default 1)", _ND, metavar="T"),
    Flag("--sp", "sequence_parallel", None, "sequence parallelism with --tp", _ND,
         const=True),
    Flag("--cp", "parallel.cp", int, "context-parallel ranks (default 1)", _ND, metavar="C"),
    Flag("--cp-method", "cp_method", str, "ring, ulysses or allgather (default ring)", _ND,
         metavar="NAME"),
    Flag("--no-zigzag", "cp_zigzag", None, "context parallelism without the zigzag split",
         _ND, const=False),
    Flag("--ep", "parallel.ep", int, "expert-parallel ranks, a view over dp·cp (default 1)",
         _ND, metavar="E"),
    Flag("--checkpoint", "checkpoint", str, "activation checkpointing: none, full, every, "
         "selective (default none)", _SPEED, metavar="POLICY"),
    Flag("--checkpoint-every", "checkpoint_every", int, "blocks per segment with "
         "--checkpoint every (default 1)", _SPEED, metavar="C"),
    Flag("--precision", "precision", str, "fp32 or bf16 (bf16 compute, fp32 master "
         "weights; default fp32)", _SPEED, metavar="{fp32,bf16}"),
    Flag("--compile", "compile", None, "torch.compile each transformer block", _SPEED,
         const=True),
    Flag("--impl", "impl", str, "labkit, or torch: PyTorch's own DDP / FSDP2 / pipelining "
         "as the reference (default labkit)", _SPEED, metavar="{labkit,torch}"),
    Flag("--fault", "fault", str, "inject faults: KIND@STEP:rankR[:key=value...] joined by "
         "commas; kinds kill, hang, stall, skip, slow, bitflip (e.g. kill@2:rank1, "
         "slow@0:rank1:seconds=0.3, bitflip@1:rank1:target=grad). The run is restarted once "
         "after a detected fault", _FAULTS, metavar="SPEC"),
    Flag("--watchdog", "watchdog_s", float, "seconds a rank may wait inside one collective "
         "before the hang is diagnosed (which rank, which collective) and the pool restarted "
         "(default: off)", _FAULTS, metavar="S"),
    Flag("--straggler", "straggler_s", float, "report, while the run goes on, a rank that "
         "enters 3 of its group's last 4 collectives S seconds after the others "
         "(default: off)", _FAULTS, metavar="S"),
    Flag("--fingerprint-every", "fingerprint_every", int, "compare data-parallel replicas' "
         "gradient and parameter checksums every K steps: silent data corruption "
         "(default 0: off)", _FAULTS, metavar="K"),
    Flag("--save-dir", "save_dir", str, "folder to save the whole training state in "
         "(every rank its shards, torch.distributed.checkpoint); created if missing, but its "
         "parent folder must exist, as --trace's", _SNAP, metavar="DIR"),
    Flag("--save-every", "save_every", int, "with --save-dir, save after every N steps "
         "(default 0: only after the last step)", _SNAP, metavar="N"),
    Flag("--resume", "resume", str, "continue from the latest snapshot in --save-dir, or "
         "from the snapshot PATH; any valid layout of the same model loads it", _SNAP,
         const=True, metavar="PATH", nargs="?"),
)

#: RunConfig fields no flag sets, and why
NOT_FLAGS = {
    "dataset": "follows the model: text for a GPT preset, digits for vit-digits "
               "(validate refuses any other pairing, so a flag could only restate it)",
    "measure_memory": "the report prints memory by category: always measured",
    "count_flops": "the report prints MFU/HFU: FLOPs are always counted",
    "return_state": "the parity tests' full parameters by name: not a report, and every "
                    "rank would send the whole model to rank 0",
    "return_grads": "the parity tests' first-step gradients by name: as return_state",
    "noise_scale": "a per-step series (B_simple) read from the job's metrics or notebook 02, "
                   "not a line of the run report",
}

#: flags that shape the output, not the run
OUTPUT_FLAGS = ("trace", "json")
#: flags of the own cluster (emulated nodes, labkit.nodes), not of the run's config
CLUSTER_FLAGS = ("nodes", "inter_node", "latency_ms")


def _dest(f: Flag) -> str:
    return "n_layers" if f.flag == "--n-layers" else f.field.split(".")[-1]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every :data:`FLAGS` entry (left out: the field keeps its default) and the
    output flags ``--trace PATH`` and ``--json`` to ``parser``."""
    groups: dict = {}
    for f in FLAGS:
        g = groups.get(f.group) or groups.setdefault(f.group, parser.add_argument_group(f.group))
        kw = dict(dest=_dest(f), default=argparse.SUPPRESS, help=f"{f.help} [{f.field}]")
        if f.type is None:
            g.add_argument(f.flag, action="store_const", const=f.const, **kw)
        elif f.nargs:
            g.add_argument(f.flag, type=f.type, nargs=f.nargs, const=f.const,
                           metavar=f.metavar, **kw)
        else:
            g.add_argument(f.flag, type=f.type, metavar=f.metavar, **kw)
    c = parser.add_argument_group("cluster (emulated nodes)")
    c.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="place the ranks in N emulated nodes, consecutive blocks of ranks "
                        "(tp innermost), each a private network namespace (labkit.nodes)")
    c.add_argument("--inter-node", default=None, metavar="RATE",
                   help="each node's link to the others, per direction: a tc rate "
                        "(default 500mbit) or bytes/s")
    c.add_argument("--latency-ms", type=float, default=None, metavar="MS",
                   help="one-way node-to-node delay (needs the kernel's netem)")
    out = parser.add_argument_group("output")
    out.add_argument("--trace", metavar="PATH", default=None,
                     help="write the run's Chrome/Perfetto trace JSON to PATH")
    out.add_argument("--json", action="store_true",
                     help="print the run as one JSON object instead of tables")


def config_from_args(args: argparse.Namespace):
    """The :class:`~labkit.config.RunConfig` the given flags describe (not validated).

    Raises:
        ValueError: ``--n-layers`` with an unknown ``--model`` preset.
    """
    from ..config import PRESETS, RunConfig, preset

    given = {k: v for k, v in vars(args).items()
             if k not in OUTPUT_FLAGS + CLUSTER_FLAGS and k not in ("command", "func")}
    model = given.pop("model", RunConfig.model)
    n_layers = given.pop("n_layers", None)
    if n_layers is not None:
        model = dataclasses.replace(preset(model), n_layers=n_layers)
    kind = model.kind if not isinstance(model, str) else getattr(PRESETS.get(model), "kind", "")
    par = {k: given.pop(k) for k in DEGREES if k in given}
    return RunConfig(model=model, dataset="digits" if kind == "vit" else "text",
                     **given).replace(**par)


class Resolved(NamedTuple):
    """A validated config, the ranks it runs on, and what the CLI changed (``notes``:
    ``{"deepened": {"from": L, "to": pp·V}}`` when the model was deepened)."""

    cfg: object
    world_size: int
    notes: dict


def _check_nodes(args: argparse.Namespace, world: int, torchrun: bool) -> None:
    """``--nodes``/``--inter-node``/``--latency-ms`` fit this run (``ValueError`` naming the
    flag and the numbers)."""
    from ..nodes import parse_rate

    nodes = getattr(args, "nodes", 1)
    extra = getattr(args, "inter_node", None) is not None or getattr(args, "latency_ms", None)
    if torchrun and (nodes != 1 or extra):
        raise ValueError("--nodes/--inter-node/--latency-ms place an own cluster's ranks; "
                         "under torchrun the nodes are torchrun's (--nnodes): run `python -m "
                         "labkit.nodes launch --nodes N -- -m labkit run ...` for emulated ones")
    if nodes < 1 or world % nodes:
        raise ValueError(f"--nodes {nodes} must divide the world size dp·tp·pp·cp = {world} "
                         "(the same number of ranks in every node)")
    if extra and nodes == 1:
        raise ValueError("--inter-node/--latency-ms shape the links between nodes: give "
                         "--nodes 2 or more")
    if getattr(args, "inter_node", None) is not None:
        parse_rate(args.inter_node)


def resolve(args: argparse.Namespace, torchrun_world: Optional[int] = None,
            check_machine: bool = True) -> Resolved:
    """Validate ``args`` into a :class:`Resolved` run, before any process starts.

    ``torchrun_world``: torchrun's ``WORLD_SIZE`` (the degrees must multiply to it), or
    ``None`` for an own cluster of ``dp·tp·pp·cp`` ranks. ``check_machine``: apply
    :func:`~labkit.preflight.check_run_fits` (not under torchrun: the launcher placed the
    processes, maybe on several nodes).

    Raises:
        UsageError: naming the field (and its flag) and the numbers.
    """
    from ..preflight import check_output_path

    if args.trace is not None and not args.trace.strip():
        raise UsageError("--trace needs a file name, got an empty one")
    try:
        check_output_path(args.trace, "--trace")
        cfg = config_from_args(args)
        cfg.parallel.validate()
        if torchrun_world is not None:
            if "watchdog_s" in vars(args):
                raise ValueError(f"watchdog_s={cfg.watchdog_s:g} is the own cluster's hang "
                                 "detector; under torchrun set TORCH_NCCL/gloo timeouts and "
                                 "torch's Flight Recorder (TORCH_FR_BUFFER_SIZE) instead")
            if "timeout_s" in vars(args):
                raise ValueError(f"timeout_s={cfg.timeout_s:g} is the own cluster's guard "
                                 "against a hung job; under torchrun the job runs in the "
                                 "launched processes and torch.distributed's own timeouts "
                                 "apply")
            cfg = _torchrun_degrees(cfg, torchrun_world, "dp" in vars(args))
        world = cfg.parallel.world_size
        notes: dict = {}
        _check_nodes(args, world, torchrun_world is not None)
        if "n_layers" not in vars(args):
            from ..parallel.pipeline.report import deepen_for_pipeline

            deep = deepen_for_pipeline(cfg)
            if deep is not cfg:
                notes["deepened"] = {"from": cfg.model_config.n_layers,
                                     "to": deep.model_config.n_layers}
            cfg = deep
        cfg.validate(world)
        if check_machine:
            from ..preflight import check_run_fits

            check_run_fits(cfg)
    except ValueError as exc:
        raise UsageError(with_flags(str(exc))) from None
    return Resolved(cfg, world, notes)


def _torchrun_degrees(cfg, world: int, dp_given: bool):
    """``cfg`` with ``dp`` filled in from torchrun's ``WORLD_SIZE`` when left out; the
    degrees must multiply to ``WORLD_SIZE``."""
    p = cfg.parallel
    others = p.tp * p.pp * p.cp
    if not dp_given and world % others == 0:
        cfg = cfg.replace(dp=world // others)
        p = cfg.parallel
    if p.world_size != world:
        raise ValueError(f"dp x tp x pp x cp = {p.dp} x {p.tp} x {p.pp} x {p.cp} = "
                         f"{p.world_size} must equal torchrun's WORLD_SIZE={world} "
                         "(nnodes x nproc-per-node)")
    return cfg


def with_flags(message: str) -> str:
    """``message`` plus the flag of each field it names whose flag is not simply the
    field's name (``zero_stage`` is ``--zero``, ``prefetch`` is ``--no-prefetch``)."""
    hints = []
    for f in FLAGS:
        name = f.field.split(".")[-1]
        if f.flag == "--" + name.replace("_", "-") or f.field == "model":
            continue
        if re.search(rf"(?<![\w.]){re.escape(name)}(=|\s+must\b|\s+does\b)", message):
            hint = f"{f.flag} sets {name}"
            if hint not in hints:
                hints.append(hint)
    return f"{message} ({'; '.join(hints)})" if hints else message

