"""Step 1 of the data path, **partition**: pure arithmetic, no tensors moved, no communication.

Parameters of one optimizer parameter group and one dtype are packed, in the order their gradients
are expected during backward, into *flat buffers* of at most ``bucket_numel`` elements (a parameter
larger than that gets a flat buffer of its own). Each flat buffer is padded to a multiple of the
data-parallel world size N and cut into N equal contiguous slices; rank r owns slice r of every flat
buffer. One flat buffer is also one gradient bucket: a single reduce-scatter delivers each rank its
slice, and a single all-gather rebuilds the whole buffer.

A :class:`Shard` records which piece of which parameter falls inside a rank's slice; slice boundaries
may cut through parameters, so a parameter can have pieces on several ranks.

Example, N = 2, parameters of 5 and 4 elements, one flat buffer::

    flat:   [a0 a1 a2 a3 a4 b0 b1 b2 b3 pad]      numel 9, padded 10, slice 5
    rank 0: [a0 a1 a2 a3 a4]                       Shard(param 0, param_offset 0, shard_offset 0, numel 5)
    rank 1: [b0 b1 b2 b3 pad]                      Shard(param 1, param_offset 0, shard_offset 0, numel 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its flat buffer."""

    offset: int
    """First element of the parameter in the flat buffer."""
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Shard:
    """The piece of parameter ``param_index`` that lies inside one rank's slice."""

    param_index: int
    """Index into :attr:`FlatLayout.slots`."""
    param_offset: int
    """First element of the piece within the flattened parameter."""
    shard_offset: int
    """First element of the piece within the rank's slice."""
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat buffer over ``world_size`` ranks."""

    slots: tuple[ParamSlot, ...]
    numel: int
    """Elements occupied by parameters."""
    world_size: int

    @property
    def padded_numel(self) -> int:
        """``numel`` rounded up to a multiple of ``world_size`` (the padding is always zero)."""
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        """Elements in each rank's slice, padding included."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s slice in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={self.world_size})")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shards(self, rank: int) -> tuple[Shard, ...]:
        """The pieces of parameters inside rank ``rank``'s slice, in flat-buffer order."""
        start, end = self.shard_range(rank)
        pieces = []
        for index, slot in enumerate(self.slots):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                pieces.append(Shard(index, lo - slot.offset, lo - start, hi - lo))
        return tuple(pieces)


def layout_flat_buffer(shapes: Sequence[torch.Size], world_size: int) -> FlatLayout:
    """Pack parameters of the given shapes back to back into one flat buffer."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    slots, offset = [], 0
    for shape in shapes:
        numel = int(torch.Size(shape).numel())
        slots.append(ParamSlot(offset, numel, torch.Size(shape)))
        offset += numel
    return FlatLayout(tuple(slots), offset, world_size)


def plan_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Split parameter indices ``0..len(numels)-1``, in the given order, into consecutive runs of at
    most ``bucket_numel`` elements; a parameter larger than a bucket forms a run of its own.

    Empty parameters (numel 0) join the current run: they add nothing and need no collective.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket_numel={bucket_numel} must be > 0")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if current and filled + numel > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(current)
    return buckets
