"""Global-offset pieces: how one rank's shards of a tensor are described to
``torch.distributed.checkpoint`` (DCP) so that any other layout can read them back.

A parameter of the full model (its *global* shape, under its full name) is held by a rank
as one or more rectangular boxes: a tensor-parallel slice, a block of experts, a FSDP2
``Shard(0)`` row range, or, under labkit's ZeRO, whatever part of a flat unit's contiguous
range ``[lo, hi)`` falls in that parameter. A contiguous range of a row-major tensor is a
union of at most ``2·ndim − 1`` boxes (:func:`range_boxes`), each itself contiguous in
memory, so every box is a *view* of the rank's storage: DCP writes straight from it and reads
straight into it.

:class:`Pieces` is DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, the hooks DTensor implements): DCP's
default planners then do what they do for DTensor — the coordinator deduplicates replicated
chunks on save, and each loading rank reads, for each of its boxes, the overlapping part of
every saved chunk (``create_read_items_for_chunk_list``). That overlap computation *is* the
resharding; nothing here knows the old layout.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["range_boxes", "Pieces", "SavePlanner", "LoadPlanner"]


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as boxes.

    Returns ``[(flat_start, offsets, sizes)]`` in memory order: each box covers the flat
    elements ``[flat_start, flat_start + prod(sizes))`` (contiguous, so ``flat[a:b].view(
    sizes)`` is the box). A 0-d tensor is one box ``(0, (), ())`` for ``[0, 1)``.

    Raises:
        ValueError: ``0 <= start <= stop <= numel`` does not hold.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) outside a tensor of {numel} elements")
    if start == stop:
        return []
    if not shape:
        return [(0, (), ())]
    if len(shape) == 1:
        return [(start, (start,), (stop - start,))]
    inner = math.prod(shape[1:])
    out = []

    def row_part(row: int, a: int, b: int) -> None:  # [a, b) inside one row
        for fs, off, sz in range_boxes(shape[1:], a, b):
            out.append((row * inner + fs, (row,) + off, (1,) + sz))

    row, a = divmod(start, inner)
    if a:
        end = min(stop - row * inner, inner)
        row_part(row, a, end)
        row, start = row + 1, row * inner + end
        if start >= stop:
            return out
    full = stop // inner
    if full > row:
        out.append((row * inner, (row,) + (0,) * (len(shape) - 1),
                    (full - row,) + shape[1:]))
    if stop > full * inner:
        row_part(full, 0, stop - full * inner)
    return out


class Pieces:
    """One rank's boxes of a global tensor, for DCP.

    Args:
        shape: the global shape (the full model's parameter, or its Adam moment).
        chunks: ``[(offsets, tensor)]``: ``tensor`` (a view of the rank's storage, shape =
            the box's sizes) sits at ``offsets`` in the global tensor. Boxes of one rank do
            not overlap; boxes of different ranks are equal or disjoint (replicas).
    """

    def __init__(self, shape: Sequence[int], chunks: list):
        self.shape = torch.Size(shape)
        self.chunks = [(torch.Size(o), t) for o, t in chunks]
        for o, t in self.chunks:
            if len(o) != len(self.shape) or any(a + s > n for a, s, n in
                                                zip(o, t.shape, self.shape)):
                raise ValueError(f"box at {tuple(o)} of size {tuple(t.shape)} outside "
                                 f"{tuple(self.shape)}")

    def size(self) -> torch.Size:
        return self.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.chunks)

    def __create_write_items__(self, fqn: str, obj) -> list:
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=o, sizes=t.shape),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.shape))
                for o, t in self.chunks]

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for o, t in self.chunks:
            if o == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no box at {tuple(index.offset)} on this rank")


def _lookup(state: dict, index: MetadataIndex, fallback):
    obj = state.get(index.fqn)
    if isinstance(obj, Pieces):
        return obj.__get_tensor_shard__(index)
    return fallback(index)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reading :class:`Pieces` by offset; records the plan it
    was finally given (what this rank writes after deduplication)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index, super().lookup_object)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, writing into :class:`Pieces` by offset. Keys the caller
    did not ask for are ignored (the other ranks' RNG states); keys it asked for were
    checked to exist before launch (:mod:`labkit.snapshot.folder`)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=True)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's meta-tensor initialisation walks the values and maps types it does not
        # know to None: hand it the plain tensors only
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, super().lookup_tensor)

    def finish_plan(self, new_plan):
        self.read_plan = new_plan  # what this rank reads: see labkit.snapshot.state.reads
        return super().finish_plan(new_plan)
