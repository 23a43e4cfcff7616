"""One way to lay a model out: the degrees ``[TP, CP, PP, DP]`` and every knob that matters.

A :class:`Layout` is pure data; :meth:`Layout.check` raises ``ValueError`` naming the field
and the numbers when the layout cannot run the model (DESIGN §9 "validate once"):
heads, key/value heads and MLP width divisible by ``tp``; sequence by ``cp``; layers at
least ``pp · V``; the global batch divisible by ``dp · microbatch`` — the batch is a budget
that data parallelism and pipeline microbatches share (claim C38). Expert parallelism
``ep`` is a view over the ``dp·cp`` ranks, as in labkit's mesh (:mod:`labkit.mesh`): it
adds no GPUs, splits each mixture-of-experts block's ``E`` experts into ``E/ep`` per rank,
and needs ``ep | dp·cp`` and ``ep | E``.

Ranks are numbered with the first axis of ``order`` varying fastest. The default order is
Llama 3's ``[TP, CP, PP, DP]`` (Dubey et al. 2024, §3.3.2, claim C36): tensor parallelism
innermost, inside a server; data parallelism outermost.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["AXES", "SCHEDULES", "CHECKPOINTS", "Layout", "stage_layers", "layout_from_mesh"]

#: the four parallel axes, innermost first (claim C36)
AXES = ("tp", "cp", "pp", "dp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
CHECKPOINTS = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """Degrees and knobs of one training layout.

    Attributes:
        tp, cp, pp, dp: tensor-, context-, pipeline- and data-parallel degrees.
        zero: ZeRO stage over the ``dp·cp`` ranks that hold the same weights (0 plain DP,
            1 optimizer state sharded, 2 + gradients, 3 + parameters = FSDP).
        microbatch: sequences per microbatch on one data-parallel rank (``b``).
        global_batch: sequences per optimizer step over all ranks (``B``).
        seq_len: tokens per sequence ``s``; ``None`` takes the model's.
        schedule: pipeline schedule ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        virtual_stages: model chunks per pipeline rank ``V`` (interleaved only).
        checkpoint: activation recomputation ``"none"``, ``"selective"`` (the attention
            core, Korthikanti et al. 2022 §5) or ``"full"`` (every layer from its input).
        sequence_parallel: shard norms and dropout along the sequence over the ``tp`` ranks
            (Korthikanti et al. 2022 §4.2.2).
        dp_shard: HSDP: ZeRO-3 inside groups of ``dp_shard`` of the ``dp·cp`` ranks,
            replicas across them; ``None`` shards over all of them.
        order: the axes innermost first; the first varies fastest in the rank number.
        ep: expert parallelism over the ``dp·cp`` ranks (a view: no extra GPUs); ranks
            ``ep`` apart in ``dp·cp`` hold the same experts (the expert-data group).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 1
    microbatch: int = 1
    global_batch: int = 8
    seq_len: Optional[int] = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    checkpoint: str = "none"
    sequence_parallel: bool = True
    dp_shard: Optional[int] = None
    order: tuple = AXES
    ep: int = 1

    # ------------------------------------------------------------------ derived
    @property
    def n_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        """Microbatches per step on each pipeline: ``m = B / (dp · b)``."""
        return self.global_batch // (self.dp * self.microbatch)

    @property
    def shard_group(self) -> int:
        """Ranks one ZeRO shard group spans: ``dp_shard`` or ``dp · cp``."""
        return self.dp_shard or self.dp * self.cp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (needs ``tp > 1``)."""
        return self.sequence_parallel and self.tp > 1

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours of ``axis``: product of the inner degrees."""
        s = 1
        for a in self.order:
            if a == axis:
                return s
            s *= getattr(self, a)
        raise ValueError(f"unknown axis {axis!r}; axes: {', '.join(AXES)}")

    def coords(self, rank: int) -> list[int]:
        """``[tp, cp, pp, dp]`` coordinates of ``rank`` (claim C36's 4-D index).

        Raises:
            ValueError: ``rank`` outside ``0 … n_gpus − 1``.
        """
        if isinstance(rank, bool) or int(rank) != rank or not 0 <= rank < self.n_gpus:
            raise ValueError(f"rank must be in 0..{self.n_gpus - 1}, got {rank!r}")
        out, r = {}, int(rank)
        for a in self.order:
            out[a] = r % getattr(self, a)
            r //= getattr(self, a)
        return [out[a] for a in AXES]

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def check(self, model) -> "Layout":
        """Raise ``ValueError`` naming the field and the numbers if ``model`` (a
        :class:`~labkit.plan.models.PlanModel`) cannot run with this layout; else ``self``."""
        for f in ("tp", "cp", "pp", "dp", "microbatch", "global_batch", "virtual_stages",
                  "ep"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.schedule!r}")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}, "
                             f"got {self.checkpoint!r}")
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"order must be a permutation of {AXES}, got {self.order!r}")
        s = self.seq_len if self.seq_len is not None else model.seq_len
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"seq_len must be a positive int, got {s!r}")
        t = self.tp
        if model.n_heads % t:
            raise ValueError(f"tp={t} does not divide n_heads={model.n_heads}")
        if model.n_kv_heads % t and t % model.n_kv_heads:
            raise ValueError(f"tp={t} and n_kv_heads={model.n_kv_heads}: one must divide the "
                             "other (key/value heads are split or replicated)")
        e = getattr(model, "n_experts", 0)
        if model.d_ff % t and not e:  # experts stay whole on every tp rank (labkit's TP)
            raise ValueError(f"tp={t} does not divide the MLP width d_ff={model.d_ff}")
        if e and self.sp:
            raise ValueError(f"sequence_parallel=True with tp={t} and n_experts={e}: the "
                             "experts stay whole on every tp rank and route the whole "
                             "sequence; set sequence_parallel=False")
        if self.ep > 1 and not e:
            raise ValueError(f"ep={self.ep} needs a mixture-of-experts model; "
                             f"{model.name!r} is dense (n_experts=0)")
        if e % self.ep:
            raise ValueError(f"ep={self.ep} does not divide n_experts={e}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide the data ranks dp x cp = {self.dp} x "
                             f"{self.cp} = {self.dp * self.cp} (it is a view over them)")
        if s % self.cp:
            raise ValueError(f"cp={self.cp} does not divide seq_len={s}")
        if self.virtual_stages > 1 and (self.schedule != "interleaved" or self.pp == 1):
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule="
                             f"'interleaved' and pp > 1 (got {self.schedule!r}, pp={self.pp})")
        if model.n_layers < self.pp * self.virtual_stages:
            raise ValueError(f"pp x virtual_stages = {self.pp} x {self.virtual_stages} = "
                             f"{self.pp * self.virtual_stages} exceeds n_layers="
                             f"{model.n_layers}")
        if self.global_batch % (self.dp * self.microbatch):
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp x "
                             f"microbatch = {self.dp} x {self.microbatch} = "
                             f"{self.dp * self.microbatch} (the batch is shared by data "
                             "parallelism and microbatches)")
        m = self.microbatches
        if self.schedule == "interleaved" and self.pp > 1 and m % self.pp:
            raise ValueError(f"the interleaved schedule needs microbatches={m} divisible by "
                             f"pp={self.pp} (Narayanan et al. 2021 §2.2.2)")
        if self.dp_shard is not None:
            if self.zero != 3:
                raise ValueError(f"dp_shard={self.dp_shard} (HSDP) needs zero=3, got "
                                 f"zero={self.zero}")
            n = self.dp * self.cp
            if not isinstance(self.dp_shard, int) or self.dp_shard < 1 or n % self.dp_shard:
                raise ValueError(f"dp_shard={self.dp_shard!r} must divide dp x cp = {n}")
        return self


#: labkit.mesh.Mesh's axes innermost first (``pp, dp_replicate, dp_shard, cp, tp`` outer to
#: inner, Megatron-Core's and torchtitan's order), as planner axes
MESH_ORDER = ("tp", "cp", "dp", "pp")


def layout_from_mesh(mesh, *, zero: int = 1, **knobs) -> Layout:
    """The :class:`Layout` of a :class:`labkit.mesh.Mesh` (the lab's live run), to plan the
    same layout on another model and cluster.

    ``dp = dp_replicate · dp_shard``; with ``dp_replicate > 1`` and ZeRO-3 the run is HSDP
    whose shard group is the mesh's ``fsdp`` view, ``dp_shard · cp``. Rank order follows the
    mesh (PP outermost). ``knobs`` are the other :class:`Layout` fields (microbatch,
    global_batch, seq_len, schedule, virtual_stages, checkpoint, sequence_parallel).
    """
    dp = mesh.dp_replicate * mesh.dp_shard
    hsdp = zero == 3 and mesh.dp_replicate > 1
    return Layout(tp=mesh.tp, cp=mesh.cp, pp=mesh.pp, dp=dp, zero=zero,
                  dp_shard=mesh.dp_shard * mesh.cp if hsdp else None, order=MESH_ORDER,
                  ep=getattr(mesh, "ep", 1), **knobs)


def stage_layers(n_layers: int, pp: int) -> list[int]:
    """Transformer layers on each pipeline rank: labkit's own split
    (:func:`labkit.parallel.pipeline.split.stage_layer_counts`).

    Equal when ``pp`` divides ``n_layers``; otherwise every rank gets ``⌈L/pp⌉`` and the
    shortfall is taken from the first and last ranks alternately, which also carry the
    embedding and the output head — Llama 3 405B's 126 layers on 16 stages: 7, 8, …, 8, 7
    (Dubey et al. 2024 §3.3.2).
    """
    from labkit.parallel.pipeline.split import stage_layer_counts

    return stage_layer_counts(n_layers, pp)
