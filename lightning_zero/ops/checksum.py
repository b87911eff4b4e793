"""CRC-32 of checkpoint bytes (zlib's polynomial): compiled, or ``zlib.crc32`` as the reference.

Every checkpoint file's CRC-32 is computed while it is written and checked before it is read
(:mod:`lightning_zero.checkpoint`). zlib's byte-wise code runs at ~3 GB/s, which made the check of
a resumed rank file take as long as reading it from the page cache; ``torch.ops.lightning_zero.crc32``
(csrc/cpu/crc32.cpp) folds 64 bytes at a time with carry-less multiplications (PCLMULQDQ, any
x86-64 of the last decade), ~10 GB/s on one core, and gives the same value, so checkpoints written
with either check with the other. Without the compiled extension :func:`crc32` is ``zlib.crc32``,
after the package's one-time warning that the extension is missing. The op releases the GIL, like
``zlib.crc32`` on large buffers, so a thread can checksum while another writes or reads.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import torch

from lightning_zero.ops._load import _warn_fallback, compiled

_SMALL = 1 << 16
"""Below this many bytes zlib is as fast as a call through the dispatcher."""

# torch.frombuffer warns, once per process (TORCH_WARN_ONCE), that a read-only buffer (what torch.save
# hands its writer, a memory map opened for reading) gives a writable tensor; the kernel only reads,
# so for us it is noise: the one warning is spent here, at import, in silence. (A later frombuffer of
# a read-only buffer elsewhere in the process then does not warn either, as after any first one.)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def crc32(data: Any, value: int = 0) -> int:
    """``zlib.crc32(data, value)``: the CRC-32 of the bytes of ``data`` (any object with the buffer
    protocol: bytes, a memoryview of a memory map, a NumPy array), continuing from ``value``."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.nbytes < _SMALL:
        return zlib.crc32(view, value)
    if not compiled():
        _warn_fallback()
        return zlib.crc32(view, value)
    return int(torch.ops.lightning_zero.crc32(torch.frombuffer(view, dtype=torch.uint8), value))


def implementation() -> str:
    """``"compiled"`` (csrc/cpu/crc32.cpp) or ``"zlib"`` (the extension is not built)."""
    return "compiled" if compiled() else "zlib"
