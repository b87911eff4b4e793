"""Collectives of :mod:`lightning_zero.comm` not covered through a strategy, on 2 spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed


def _tensors(rank: int) -> list[torch.Tensor]:
    """Odd shapes, three dtypes, a transposed (non-contiguous) one and one larger than the 64-byte
    buckets below; each rank's values differ."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(7, generator=g),
        torch.randn(3, 5, generator=g),
        torch.randint(0, 100, (), generator=g),  # int64, a BatchNorm count
        torch.randn(5, 3, generator=g).t(),
        torch.randn(4, generator=g).to(torch.bfloat16),
        torch.randn(41, generator=g),
        torch.randn(2, generator=g),
        torch.nn.Parameter(torch.randn(3, generator=g)),  # written in place without autograd
    ]


def _broadcast_each_worker(rank: int) -> list[torch.Tensor]:
    from lightning_zero import comm

    dist.init_process_group("gloo")
    try:
        tensors = _tensors(rank)
        comm.broadcast_each(tensors, 1, None, bucket_bytes=64)
        return [t.detach().clone() for t in tensors]
    finally:
        dist.destroy_process_group()


def test_broadcast_each_copies_the_source_rank_exactly():
    source = _tensors(1)
    for received in run_ranks(_broadcast_each_worker):
        # a copy of group rank 1's values (no arithmetic): equal bit for bit, shapes and dtypes kept
        for got, want in zip(received, source, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want.detach())
