"""What fault to inject where: :class:`FaultSpec`, its one-line form, and its checks.

A fault is written ``KIND@STEP:rankR[:key=value…]`` (the CLI's ``--fault``, and
``RunConfig(fault=…)``), several separated by ``,``:

=========  ==========================================================================
kill       the rank SIGKILLs itself at the start of step ``STEP`` (a crashed host)
hang       the rank stalls at its first collective of step ``STEP``, before handing it
           to the backend, for ``seconds`` (default: until the watchdog kills it)
stall      the rank enters its first collective of step ``STEP`` (its flight record says
           so) and then freezes (``SIGSTOP``, as a host whose process is no longer
           scheduled): every member entered, none completes — a stall inside the backend
skip       the rank skips its first collective ``op`` (default ``all_reduce``) of step
           ``STEP``: every later collective of that group is then off by one
slow       the rank sleeps ``seconds`` (default 0.2) at the start of every step from
           ``STEP`` on (a straggler: a throttled or noisy-neighbour host)
bitflip    the rank flips bit ``bit`` (default 30, the top exponent bit of an fp32) of
           element ``index`` (default 0) of its ``target`` (``grad``: the first parameter's
           reduced gradient, before the optimizer; ``param``: the first parameter, after
           it) at step ``STEP``; ``persistent=1`` flips it again on every re-run of the
           step (a bad chip, not a cosmic ray)
=========  ==========================================================================

Examples: ``"kill@3:rank1"``, ``"hang@2:rank0:seconds=30"``, ``"slow@0:rank3:seconds=0.3"``,
``"bitflip@2:rank1:target=grad:bit=22:persistent=1"``.

Megatron-Core's fault injector (``megatron/training/ft_integration`` and the re-run state
machine) and torchft inject the same kinds from a shell; here they are config fields, so a
notebook cell injects them and :func:`check_faults` refuses an impossible one before any
rank starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Optional, Union

__all__ = ["FaultSpec", "KINDS", "parse_faults", "check_faults"]

KINDS = ("kill", "hang", "skip", "slow", "bitflip", "stall")
_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
_PATTERN = re.compile(r"^\s*([a-z]+)\s*@\s*(-?\d+)\s*:\s*rank\s*(-?\d+)\s*((?::[^:,]+)*)\s*$")


@dataclass(frozen=True)
class FaultSpec:
    """One injected fault (see the module docstring for the kinds).

    Attributes:
        kind: ``"kill"``, ``"hang"``, ``"stall"``, ``"skip"``, ``"slow"`` or ``"bitflip"``.
        step: training step (0-based) at which it happens.
        rank: global rank it happens on.
        seconds: ``hang``: how long the stall lasts (``None``: until killed); ``slow``:
            seconds added to each step (default 0.2).
        op: ``skip``: the collective skipped.
        target: ``bitflip``: ``"grad"`` or ``"param"``.
        bit: ``bitflip``: bit 0–31 of the fp32 word.
        index: ``bitflip``: flat element index in the first parameter.
        persistent: ``bitflip``: flip again on every re-run of the step.
    """

    kind: str
    step: int
    rank: int
    seconds: Optional[float] = None
    op: str = "all_reduce"
    target: str = "grad"
    bit: int = 30
    index: int = 0
    persistent: bool = False

    def __str__(self) -> str:
        extra = ""
        if self.seconds is not None:
            extra += f":seconds={self.seconds:g}"
        if self.kind == "skip" and self.op != "all_reduce":
            extra += f":op={self.op}"
        if self.kind == "bitflip":
            extra += f":target={self.target}:bit={self.bit}:index={self.index}"
            extra += ":persistent=1" if self.persistent else ""
        return f"{self.kind}@{self.step}:rank{self.rank}{extra}"

    @property
    def delay_s(self) -> float:
        """``slow``: seconds added to each step."""
        return 0.2 if self.seconds is None else float(self.seconds)


def _parse_one(text: str) -> FaultSpec:
    m = _PATTERN.match(text)
    if not m:
        raise ValueError(f"fault {text!r} is not of the form KIND@STEP:rankR[:key=value...] "
                         f"(e.g. 'kill@3:rank1'); kinds: {', '.join(KINDS)}")
    kind, step, rank, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    known = {f.name for f in fields(FaultSpec)}
    kw: dict = {}
    for item in filter(None, rest.split(":")):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in known or key in ("kind", "step", "rank"):
            raise ValueError(f"fault {text!r}: unknown option {item!r}; options are seconds=, "
                             "op=, target=, bit=, index=, persistent=")
        val = val.strip()
        try:
            kw[key] = (float(val) if key == "seconds" else int(val) if key in ("bit", "index")
                       else val.lower() in ("1", "true", "yes") if key == "persistent" else val)
        except ValueError:
            raise ValueError(f"fault {text!r}: {key}={val!r} is not a number") from None
    return FaultSpec(kind, step, rank, **kw)


def parse_faults(value: Union[None, str, FaultSpec, tuple, list]) -> tuple:
    """``value`` as a tuple of :class:`FaultSpec` (``None`` → ``()``).

    Raises:
        ValueError: a string not of the form ``KIND@STEP:rankR[:key=value…]``.
        TypeError: something that is neither a string, a ``FaultSpec`` nor a list of them.
    """
    if value is None or value == "":
        return ()
    if isinstance(value, FaultSpec):
        return (value,)
    if isinstance(value, str):
        return tuple(_parse_one(part) for part in value.split(",") if part.strip())
    if isinstance(value, (tuple, list)):
        return tuple(f for v in value for f in parse_faults(v))
    raise TypeError(f"fault must be a string like 'kill@3:rank1', a FaultSpec or a list of "
                    f"them, got {type(value).__name__}")


def check_faults(faults: tuple, world_size: int, steps: int, *, dp: int = 1,
                 zero_stage: int = 0, pp: int = 1, impl: str = "labkit") -> None:
    """Refuse a fault that cannot happen in this run, naming the field and the numbers.

    Raises:
        ValueError: an unknown kind, a step outside ``0 … steps−1``, a rank outside
            ``0 … world_size−1``, a bad option, or a ``bitflip`` on a run without full
            data-parallel replicas (``dp >= 2``, ZeRO 0, no pipeline, labkit's own DDP).
    """
    for f in faults:
        if f.kind not in KINDS:
            raise ValueError(f"fault {f}: kind {f.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(f.step, int) or not 0 <= f.step < steps:
            raise ValueError(f"fault {f}: step={f.step} is outside the run's steps 0..{steps - 1} "
                             f"(steps={steps})")
        if not isinstance(f.rank, int) or not 0 <= f.rank < world_size:
            raise ValueError(f"fault {f}: rank={f.rank} is outside the job's ranks "
                             f"0..{world_size - 1} (world_size={world_size})")
        if f.seconds is not None and not f.seconds > 0:
            raise ValueError(f"fault {f}: seconds={f.seconds} must be > 0")
        if f.kind == "stall" and f.seconds is not None:
            raise ValueError(f"fault {f}: a stall lasts until the watchdog kills the rank; "
                             f"seconds={f.seconds:g} is for hang and slow")
        if f.kind == "skip" and f.op not in _OPS:
            raise ValueError(f"fault {f}: op={f.op!r} is not one of {', '.join(_OPS)}")
        if f.kind == "bitflip":
            if f.target not in ("grad", "param"):
                raise ValueError(f"fault {f}: target={f.target!r} must be 'grad' or 'param'")
            if not 0 <= f.bit <= 31:
                raise ValueError(f"fault {f}: bit={f.bit} must be 0..31 (an fp32 word)")
            if f.index < 0:
                raise ValueError(f"fault {f}: index={f.index} must be >= 0")
            if dp < 2 or zero_stage != 0 or pp != 1 or impl != "labkit":
                raise ValueError(
                    f"fault {f}: a bit flip into one data-parallel replica needs full replicas "
                    f"to compare: dp >= 2 with zero_stage=0, pp=1 and impl='labkit' (got dp={dp},"
                    f" zero_stage={zero_stage}, pp={pp}, impl={impl!r})")
    kills = [f for f in faults if f.kind in ("kill", "hang", "skip", "stall")]
    if len(kills) > 1:
        raise ValueError(f"faults {', '.join(map(str, kills))}: at most one kill/hang/skip/"
                         "stall per run (the first ends the job)")
