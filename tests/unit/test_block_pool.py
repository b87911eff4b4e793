"""BlockPool (lightning_zero/zero/pools.py): what it keeps between steps and that the steady state
allocates nothing. A "step" here is a fixed sequence of takes and gives, as the engine's buckets and
stage-3 gathers make one (the same every step)."""

from __future__ import annotations

import torch

from lightning_zero.zero.pools import BlockPool

CPU = torch.device("cpu")


def _kept(pool: BlockPool) -> list[int]:
    return sorted(t.numel() for t in pool.free)


def test_a_block_too_small_for_a_later_request_is_given_up():
    # a small bucket done before a larger one starts, then two larger ones at once: the small
    # block could only ever be taken by a request the larger blocks serve as well
    pool = BlockPool()
    for _ in range(3):
        small = pool.take(100, torch.float32, CPU)
        pool.give(small)
        a = pool.take(150, torch.float32, CPU)
        b = pool.take(150, torch.float32, CPU)
        pool.give(a)
        pool.give(b)
    assert _kept(pool) == [150, 150]  # not [100, 150, 150]
    assert pool.allocations == 3  # all in the first step (the small block, then the two large ones)


def test_a_size_given_up_and_needed_again_is_kept():
    # the small request comes back while the large block is in use: giving it up again every step
    # would allocate every step; after one round trip it stays
    pool = BlockPool()
    counts = []
    for _ in range(4):
        small = pool.take(100, torch.float32, CPU)
        pool.give(small)
        large = pool.take(150, torch.float32, CPU)
        again = pool.take(100, torch.float32, CPU)
        pool.give(again)
        pool.give(large)
        counts.append(pool.allocations)
    assert counts[1:] == [counts[1]] * 3, counts  # nothing allocated after the second step
    assert _kept(pool) == [100, 150]


def test_other_dtypes_and_sizes_beyond_fit_are_left_alone():
    pool = BlockPool()
    pool.give(pool.take(10, torch.float32, CPU))  # more than FIT times smaller than 150
    pool.give(pool.take(100, torch.bfloat16, CPU))  # another dtype
    pool.give(pool.take(150, torch.float32, CPU))
    assert sorted((t.numel(), t.dtype) for t in pool.free) == [
        (10, torch.float32),
        (100, torch.bfloat16),
        (150, torch.float32),
    ]


def test_a_size_whose_blocks_are_all_out_gets_its_own_block_not_a_larger_one():
    # The stage-3 pattern: the sizes taken at a hook are not the ones given back since the last. A
    # second 100 while the only 100 is out, with a free 150 (a size that is needed again right after):
    # borrowing the 150 would make the next 150 miss and allocate, and the pool would keep
    # [100, 150, 150] (step after step, the larger blocks win) where [100, 100, 150] serves the step.
    pool = BlockPool()
    counts = []
    for _ in range(3):
        a = pool.take(100, torch.float32, CPU)
        b = pool.take(150, torch.float32, CPU)
        pool.give(b)
        c = pool.take(100, torch.float32, CPU)
        d = pool.take(150, torch.float32, CPU)
        for block in (a, c, d):
            pool.give(block)
        counts.append(pool.allocations)
    assert _kept(pool) == [100, 100, 150]
    assert counts == [3, 3, 3]  # all in the first step
    assert pool.in_use_bytes == 0
