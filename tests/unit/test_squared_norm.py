"""The sum of squares behind the global gradient norm (lightning_zero/zero/swap_grads.py
``squared_norm``, on the host :func:`lightning_zero.ops.functional.cpu_sum_squares`): the disk tier
takes it from the reduced bf16 slice, the in-memory path from the fp32 ``master.grad`` (the same
values, cast); clipping, the non-finite check and the parity of the two tiers need the two to agree
bit for bit, on every path (each ISA of the compiled kernel, and the reference), above one chunk."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.ops._load import ISA_ENV, supported_isas
from lightning_zero.ops.reference import SUM_SQUARES_CHUNK
from lightning_zero.zero.swap_grads import squared_norm

PATHS = supported_isas() + ["reference"]
# one partial chunk (and a tail shorter than any vector), exactly one chunk, several plus a tail
SIZES = (7, SUM_SQUARES_CHUNK, 2 * SUM_SQUARES_CHUNK + 12345)


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(ISA_ENV, request.param)
    return request.param


def test_a_bf16_slice_and_its_fp32_cast_give_the_same_bits_across_chunks(path):
    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        grad = (torch.randn(n, generator=g) * 3).bfloat16()
        ours = squared_norm(grad)
        assert ours.dtype == torch.float32 and ours.dim() == 0
        assert torch.equal(ours, squared_norm(grad.float())), (path, n)
        # and it is the sum of squares: torch's fp32 vector_norm over a million elements is within
        # ~1e-4 of the fp64 sum (measured 8e-5 chunked); the kernel's fp32 blocks of 4096 added in
        # double are within ~1e-6; 5e-4 bounds both and still catches a lost or doubled block
        exact = grad.double().square().sum()
        torch.testing.assert_close(ours.double(), exact, rtol=5e-4, atol=0)


@pytest.mark.parametrize("isa", supported_isas())
def test_the_kernel_adds_in_a_fixed_order_whatever_the_threads(isa, monkeypatch):
    """Per ISA the result is a function of the data only: the same bits on 1 and 2 threads (the
    chunks run on any thread; their sums are added in order), and close to the reference."""
    monkeypatch.setenv(ISA_ENV, isa)
    grad = torch.randn(3 * SUM_SQUARES_CHUNK + 999, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = squared_norm(grad)
        torch.set_num_threads(2)
        two = squared_norm(grad)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    exact = grad.double().square().sum()
    # the kernel: fp32 sums over 4096-element blocks (64 per lane at AVX-512), in double above
    # that: relative error ~1e-7; 1e-5 is far above it and far below a lost element (~3e-7 of
    # 3.1M here is one element: the check below is on values, a dropped element fails the next)
    torch.testing.assert_close(one.double(), exact, rtol=1e-5, atol=0)
    head = grad[: 4096 * 3 + 5]  # a dropped tail element or block is caught exactly here
    torch.testing.assert_close(squared_norm(head).double(), head.double().square().sum(), rtol=1e-6, atol=0)


def test_non_finite_values_propagate(path):
    """The step skips on a non-finite norm: an inf or a NaN anywhere (also in a tail) must show."""
    for bad, check in ((float("inf"), torch.isinf), (float("nan"), torch.isnan)):
        for where in (0, SUM_SQUARES_CHUNK + 3, 2 * SUM_SQUARES_CHUNK + 12344):
            grad = torch.ones(2 * SUM_SQUARES_CHUNK + 12345, dtype=torch.bfloat16)
            grad[where] = bad
            assert check(squared_norm(grad)), (path, bad, where)


def test_fp64_stays_fp64(path):
    grad = torch.randn(SUM_SQUARES_CHUNK + 3, dtype=torch.float64)
    assert squared_norm(grad).dtype == torch.float64
    torch.testing.assert_close(squared_norm(grad), grad.square().sum(), rtol=1e-12, atol=0)


def test_a_non_contiguous_view_is_summed_as_its_values():
    grad = torch.randn(64, 33)[:, :31]  # rows of a wider tensor: not contiguous
    torch.testing.assert_close(squared_norm(grad).double(), grad.double().square().sum(), rtol=1e-6, atol=0)


def test_other_dtypes_take_the_reference_and_the_op_refuses_them_by_name():
    """fp16 (and fp64 above) go to the reference; the compiled op itself names the dtypes it takes."""
    grad = torch.randn(5000, dtype=torch.float16)
    torch.testing.assert_close(squared_norm(grad).double(), grad.double().square().sum(), rtol=1e-6, atol=0)
    assert squared_norm(torch.ones(0)).item() == 0.0
    if supported_isas():  # the extension is built
        with pytest.raises(ValueError, match="float32 or bfloat16, got Half"):
            torch.ops.lightning_zero.cpu_sum_squares(grad, "auto")
