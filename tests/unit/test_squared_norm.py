"""The sum of squares behind the global gradient norm (lightning_zero/zero/swap_grads.py
``squared_norm``): the disk tier takes it from the reduced bf16 slice, the in-memory path from the
fp32 ``master.grad`` (the same values, cast); clipping, the non-finite check and the parity of the
two tiers need the two to agree bit for bit, also above one chunk."""

from __future__ import annotations

import torch

from lightning_zero.zero.swap_grads import NORM_CHUNK, squared_norm


def test_a_bf16_slice_and_its_fp32_cast_give_the_same_bits_across_chunks():
    g = torch.Generator().manual_seed(0)
    for n in (7, NORM_CHUNK, 2 * NORM_CHUNK + 12345):  # one partial chunk, exactly one, several + a tail
        grad = (torch.randn(n, generator=g) * 3).bfloat16()
        ours = squared_norm(grad)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, squared_norm(grad.float())), n
        # and it is the sum of squares: torch's fp32 vector_norm over a million elements is within
        # ~1e-4 of the fp64 sum (measured 8e-5 chunked, 9e-5 for one vector_norm over the whole
        # 2.1M slice, the path this replaces); 5e-4 bounds that and still catches a lost chunk
        exact = grad.double().square().sum()
        torch.testing.assert_close(ours.double(), exact, rtol=5e-4, atol=0)


def test_fp64_stays_fp64():
    grad = torch.randn(NORM_CHUNK + 3, dtype=torch.float64)
    assert squared_norm(grad).dtype == torch.float64
    torch.testing.assert_close(squared_norm(grad), grad.square().sum(), rtol=1e-12, atol=0)
