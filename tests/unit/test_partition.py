"""Partition arithmetic: padding, slice boundaries through parameters, bucket planning."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.zero.partition import layout_flat_buffer, plan_buckets


def _reassemble(layout, world_size):
    """Rebuild every parameter from all ranks' shards: each element must appear exactly once."""
    seen = [torch.zeros(slot.numel, dtype=torch.int64) for slot in layout.slots]
    for rank in range(world_size):
        start, end = layout.shard_range(rank)
        for piece in layout.shards(rank):
            slot = layout.slots[piece.param_index]
            assert start + piece.shard_offset == slot.offset + piece.param_offset
            assert piece.shard_offset + piece.numel <= layout.shard_numel
            seen[piece.param_index][piece.param_offset : piece.param_offset + piece.numel] += 1
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_every_element_owned_once(world_size):
    shapes = [(7, 15), (15,), (1,), (3, 5), (11, 15), (0,), (2, 3, 5)]
    layout = layout_flat_buffer(shapes, world_size)
    total = sum(torch.Size(s).numel() for s in shapes)
    assert layout.numel == total
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padded_numel - total < world_size
    for counts in _reassemble(layout, world_size):
        assert bool((counts == 1).all())


def test_slice_cuts_through_parameter():
    # 5 + 4 elements over 2 ranks: slice size 5, the second parameter lies wholly on rank 1 and
    # the padding element is the last of rank 1's slice.
    layout = layout_flat_buffer([(5,), (4,)], 2)
    assert (layout.padded_numel, layout.shard_numel) == (10, 5)
    assert [(p.param_index, p.param_offset, p.shard_offset, p.numel) for p in layout.shards(0)] == [(0, 0, 0, 5)]
    assert [(p.param_index, p.param_offset, p.shard_offset, p.numel) for p in layout.shards(1)] == [(1, 0, 0, 4)]
    # 7 x 15 = 105 elements over 4 ranks: slices of 27 cut the parameter at 27, 54, 81.
    layout = layout_flat_buffer([(7, 15)], 4)
    assert layout.padded_numel == 108
    assert [(p.param_offset, p.numel) for p in layout.shards(3)] == [(81, 24)]


def test_shard_range_rejects_bad_rank():
    layout = layout_flat_buffer([(3,)], 2)
    with pytest.raises(ValueError, match="rank=2"):
        layout.shard_range(2)


def test_plan_buckets():
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    # a parameter larger than a bucket gets a bucket of its own
    assert plan_buckets([3, 20, 3], 8) == [[0], [1], [2]]
    assert plan_buckets([0, 5, 0], 5) == [[0, 1, 2]]
    assert plan_buckets([], 5) == []
    with pytest.raises(ValueError, match="bucket_numel=0"):
        plan_buckets([1], 0)
