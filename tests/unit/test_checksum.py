"""The checkpoint files' CRC-32 (lightning_zero.ops.checksum) against its reference, zlib.crc32: the
compiled kernel folds 64 bytes at a time and finishes the last < 16 byte-wise, so sizes around those
boundaries, unaligned starts and chained calls are where it could differ. Exact equality: a checksum."""

import warnings
import zlib

import numpy as np
import pytest
import torch

from lightning_zero.ops import _load, checksum

needs_compiled = pytest.mark.skipif(not _load.compiled(), reason=f"lightning_zero._C not built: {_load._LOAD_ERROR}")

SIZES = [0, 1, 15, 16, 17, 63, 64, 65, 79, 127, 128, 129, 4097, (1 << 16) - 1, 1 << 16, (1 << 16) + 13, 1000003]


@pytest.mark.parametrize("offset", [0, 1, 7])
@pytest.mark.parametrize("value", [0, 0x12345678, 0xFFFFFFFF])
def test_crc32_equals_zlib(offset, value):
    data = np.random.default_rng(0).integers(0, 256, size=max(SIZES) + 8, dtype=np.uint8).tobytes()
    for size in SIZES:
        piece = memoryview(data)[offset : offset + size]
        assert checksum.crc32(piece, value) == zlib.crc32(piece, value), size


def test_crc32_chains_and_takes_any_buffer():
    data = np.random.default_rng(1).standard_normal(300_007).astype(np.float32)  # 1.2 MB, not a multiple of 16
    whole = zlib.crc32(data.tobytes())
    chained = 0
    for start in range(0, data.nbytes, 100_003):  # odd chunk boundaries
        chained = checksum.crc32(memoryview(data).cast("B")[start : start + 100_003], chained)
    assert chained == whole
    assert checksum.crc32(data) == whole  # a float array: its bytes
    assert checksum.crc32(torch.from_numpy(data).numpy().tobytes()) == whole


@needs_compiled
def test_compiled_op_is_the_kernel_in_use():
    assert checksum.implementation() == "compiled"
    data = np.arange(1 << 17, dtype=np.uint8)
    assert torch.ops.lightning_zero.crc32(torch.from_numpy(data), 0) == zlib.crc32(data)


def test_without_the_extension_zlib_computes_it_after_one_warning(monkeypatch):
    monkeypatch.setattr(_load, "_LOAD_ERROR", "simulated: not built")
    monkeypatch.setattr(_load, "_warned", False)
    data = bytes(range(256)) * 1024
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checksum.crc32(data) == zlib.crc32(data)
        assert checksum.crc32(data, 5) == zlib.crc32(data, 5)
    assert checksum.implementation() == "zlib"
    assert len([w for w in caught if "compiled extension is not available" in str(w.message)]) == 1
