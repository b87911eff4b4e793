"""The glibc allocator setting of ``host_mmap_threshold`` (lightning_zero.memory): set only where it
means something, and never over the user's own environment variable."""

from __future__ import annotations

import ctypes.util

import pytest

from lightning_zero import memory

GLIBC = memory._mallopt() is not None


@pytest.mark.skipif(not GLIBC, reason="mallopt is a glibc call; other C libraries are left alone (tested below)")
def test_threshold_set_on_glibc_and_the_environment_wins(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert memory.fix_mmap_threshold(1 << 20) is True
    memory.restore_mmap_threshold()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert memory.fix_mmap_threshold(1 << 20) is False  # the user's choice is kept


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    memory._glibc.cache_clear()  # looked up once per process: again, under the patch
    try:
        assert memory._mallopt() is None
        assert memory.fix_mmap_threshold(1 << 20) is False
        assert memory.heap_free_bytes() is None and memory.trim_heap() is False
        memory.restore_mmap_threshold()  # a no-op, no error
    finally:
        memory._glibc.cache_clear()  # the real C library for the tests after this one
