"""Pipeline actions and schedules as plain data (see :mod:`.schedules` for generators).

``Action(stage, kind, microbatch)`` prints as ``{stage}{kind}{microbatch}`` — ``1F0``,
``2B3``, ``0W1``, ``3BW2``, ``1SEND_F0``. Kinds: ``F`` forward; ``BW`` full backward;
``B`` input-gradient and ``W`` weight-gradient backward (the zero-bubble split, Qi et al.
2023 §2); ``SEND_F``/``RECV_F`` an activation and ``SEND_B``/``RECV_B`` a gradient crossing
ranks.
"""
from __future__ import annotations

import numbers

import re
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Action", "Schedule", "COMPUTE_KINDS", "COMM_KINDS"]

COMPUTE_KINDS = ("F", "B", "W", "BW")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_PARSE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch``. ``str`` → ``1F0``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``"2B3"`` → ``Action(2, "B", 3)``. Raises ``ValueError`` on anything else."""
        m = _PARSE.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0', '2B3', "
                             f"'0W1', '3BW2', '1SEND_F0'")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus what they were generated for.

    Attributes:
        name: generator name (a key of :data:`SCHEDULES`).
        pp: ranks ``P``; microbatches: ``M``; virtual: stages per rank ``V``.
        style: ``"loop"`` (stage ``s`` on rank ``s mod P``) or ``"v"`` (stage ``s`` on
            rank ``s`` for ``s < P``, else ``2P−1−s``: the first and last stage share rank 0).
        actions: ``actions[r]`` is rank ``r``'s ordered tuple of :class:`Action`.
        warmup: forwards each rank issues before its steady state (1F1B-type schedules),
            as the generator planned them; ``None`` where the notion does not apply.
    """

    name: str
    pp: int
    microbatches: int
    virtual: int
    style: str
    actions: tuple
    warmup: Optional[tuple] = None

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def stage_rank(self, stage: int) -> int:
        """Rank that holds ``stage``."""
        if self.style == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list:
        return [s for s in range(self.n_stages) if self.stage_rank(s) == rank]

    @property
    def split_backward(self) -> bool:
        """True when backward is split into ``B`` and ``W`` (zero-bubble schedules)."""
        return any(a.kind == "W" for acts in self.actions for a in acts)

    def table(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 …``."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts))
                         for r, acts in enumerate(self.actions))

    def __str__(self) -> str:
        return self.table()


def check_pp_ranks(pp_ranks: Optional[Sequence[int]], pp: int) -> tuple:
    """``pp_ranks`` as a tuple of ``pp`` distinct global ranks (``None`` → ``0 … pp−1``).

    Raises:
        ValueError: not ``pp`` entries, an entry that is not an int >= 0, or a repeat.
    """
    if pp_ranks is None:
        return tuple(range(pp))
    ranks = tuple(pp_ranks)
    if len(ranks) != pp:
        raise ValueError(f"pp_ranks={ranks} has {len(ranks)} entries for pp={pp} stage ranks")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0:
            raise ValueError(f"pp_ranks={ranks}: every entry must be a global rank >= 0, "
                             f"got {r!r}")
    if len(set(ranks)) != pp:
        raise ValueError(f"pp_ranks={ranks} repeats a global rank")
    return tuple(int(r) for r in ranks)
