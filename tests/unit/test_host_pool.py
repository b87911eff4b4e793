"""The disk tier's host memory pool (csrc/cpu/host_pool.cpp, behind ``host_alloc_aligned``): freed
blocks are handed out again, so a repeating step allocates nothing after the first; what it keeps
stays about the most in use at once; trimming gives everything back. A "step" is a fixed sequence of
takes and frees, as the swap store makes one (the same every step). The pool is one per process:
each test trims first and reads its counters as differences."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.offload import nvme

pytestmark = pytest.mark.skipif(
    not nvme._has_op("host_pool_stats"), reason="lightning_zero._C is not built (the pool is compiled)"
)
MiB = 1 << 20


def _ops():
    return torch.ops.lightning_zero


def _stats() -> dict[str, int]:
    in_use, kept, peak, allocations = _ops().host_pool_stats()
    return {"in_use": in_use, "kept": kept, "peak": peak, "allocations": allocations}


def _tensor(nbytes: int) -> torch.Tensor:
    """A swapped-out tensor (storage of zero bytes) of ``nbytes`` bytes, as the store keeps them."""
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    t.untyped_storage().resize_(0)
    return t


def _take(t: torch.Tensor) -> int:
    _ops().host_alloc_aligned(t)
    t.fill_(1.0)  # touched, as a read into it would
    return t.data_ptr()


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


@pytest.fixture(autouse=True)
def _trimmed():
    _ops().host_pool_trim()
    yield
    _ops().host_pool_trim()


def test_a_freed_block_is_handed_out_again_aligned():
    t = _tensor(16 * MiB)
    before = _stats()["allocations"]
    addresses = set()
    for _ in range(4):
        addresses.add(_take(t))
        _free(t)
    assert len(addresses) == 1 and _stats()["allocations"] - before == 1
    assert next(iter(addresses)) % (2 * MiB) == 0  # from 8 MiB: huge-page aligned (O_DIRECT needs 4096)
    small = _tensor(12 * 1024)
    assert _take(small) % 4096 == 0
    _free(small)


def test_a_free_block_up_to_a_quarter_larger_serves_a_request():
    # sub-groups of one model differ a little in size (the last one, the embedding's); a block much
    # larger than the request would hold memory nobody uses
    big, near, half = _tensor(20 * MiB), _tensor(16 * MiB), _tensor(10 * MiB)
    start = _stats()["allocations"]
    address = _take(big)
    _free(big)
    assert _take(near) == address  # 16 MiB from the free 20 MiB block: no allocation
    assert _stats()["allocations"] - start == 1
    _free(near)
    assert _take(half) != address  # 10 MiB: the 20 MiB block is twice that, a block of its own
    assert _stats()["allocations"] - start == 2
    _free(half)


def test_the_steady_state_allocates_nothing_and_keeps_about_the_peak():
    # a step: one small buffer alone, then two large ones at once, then both freed (the small one
    # is below half the large ones, so it cannot take one of their blocks)
    small, a, b = _tensor(4 * MiB), _tensor(40 * MiB), _tensor(40 * MiB)
    counts, held = [], []
    start = _stats()["allocations"]
    for _ in range(5):
        _take(small)
        _free(small)
        _take(a)
        _take(b)
        _free(a)
        _free(b)
        s = _stats()
        counts.append(s["allocations"] - start)
        held.append(s["in_use"] + s["kept"])
    # step 1 allocates the three; step 2 asks again for the small size given back when the large
    # ones came (that raises the bound by its size, for good); from step 3 on nothing is allocated
    assert counts[2:] == [counts[1]] * 3, counts
    assert counts[1] - counts[0] <= 1, counts
    # what it keeps: the two large blocks and the small one, never more
    assert held[-1] <= 84 * MiB, held


def test_blocks_beyond_the_peak_in_use_are_given_back():
    # the sizes change for good (e.g. a second model): the old free blocks are not all kept on top
    olds = [_tensor(24 * MiB) for _ in range(3)]
    for t in olds:
        _take(t)
    for t in olds:
        _free(t)
    peak = _stats()["peak"]
    new = _tensor(100 * MiB)  # fits no free block: allocated; the 72 MiB kept would pass the peak
    _take(new)
    s = _stats()
    assert s["in_use"] + s["kept"] <= max(peak, s["in_use"]), s
    _free(new)


def test_trim_gives_every_free_block_back():
    t = _tensor(16 * MiB)
    _take(t)
    _free(t)
    assert _stats()["kept"] >= 16 * MiB
    _ops().host_pool_trim()
    s = _stats()
    assert s["kept"] == 0 and s["peak"] == s["in_use"]


def test_the_store_trims_the_pool_when_it_closes(tmp_path):
    from lightning_zero.config import NvmeConfig

    store = nvme.SwapStore(NvmeConfig(path=str(tmp_path), block_size=4096), rank=0, engine="threads")
    t = torch.arange(3 * MiB, dtype=torch.float32)
    store.evict([("x", t)])
    store.release([("x", t)])
    store.fetch([("x", t)])
    store.wait([("x", t)])
    assert torch.equal(t, torch.arange(3 * MiB, dtype=torch.float32))  # read back into a pool block
    store.release([("x", t)])
    assert _stats()["kept"] > 0
    store.fetch([("x", t)])  # in memory when the store closes (as states brought back are)
    store.wait([("x", t)])
    store.close(bring_back=False)
    assert _stats()["kept"] == 0
    in_use = _stats()["in_use"]
    del t  # outliving the store: its block goes back to the allocator, not into the pool
    s = _stats()
    assert s["kept"] == 0 and s["in_use"] == in_use - 12 * MiB, s
