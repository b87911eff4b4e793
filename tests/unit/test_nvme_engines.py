"""The disk tier's I/O engines against each other (:mod:`lightning_zero.offload.nvme`): the io_uring
engine (csrc/cpu/swap_uring.cpp) moves the same bytes as the thread engine (csrc/cpu/swap_io.cpp)
and the Python reference, writes the same files, takes the no-bounce path on aligned memory and the
bounce path elsewhere, reports failures with the file and errno text, and falls back (with one
warning) where io_uring is unavailable. Every comparison is exact: I/O moves bytes, no arithmetic."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from lightning_zero.config import NvmeConfig
from lightning_zero.offload import nvme
from lightning_zero.offload.nvme import SwapStore

URING = nvme.io_uring_probe(8)
needs_uring = pytest.mark.skipif(URING is not None, reason=f"io_uring unavailable here: {URING}")
needs_compiled = pytest.mark.skipif(not nvme.compiled_engine(), reason="lightning_zero._C not built")

BLOCK = 16384  # small blocks so that a few hundred KB span many requests (more than queue_depth)
# element counts (fp32): 1 and 1023 are below one block, 4096 is exactly one block, 278011 ends in a
# partial block (as the kernels' tests), 3 * 4096 + 1 is one element past a block boundary
SIZES = [1, 1023, 4096, 278011, 3 * 4096 + 1]


def _config(tmp_path, engine: str, **knobs) -> NvmeConfig:
    return NvmeConfig(path=str(tmp_path / engine), block_size=BLOCK, queue_depth=4, aio_engine=engine, **knobs)


def _unaligned(n: int) -> torch.Tensor:
    """A tensor whose address is not 4096-aligned (a view 4 bytes into a torch allocation)."""
    t = torch.randn(n + 1)[1:]
    assert t.data_ptr() % 4096 != 0
    return t


def _round_trip(tmp_path, engine: str, source: dict[str, torch.Tensor], aligned: bool) -> dict[str, bytes]:
    """Write ``source`` through a store of ``engine``, read it back into fresh memory; returns the
    files' bytes. Aligned: the tensors are written from memory the store allocated (as in training,
    after their first read); else from torch's allocations (64-byte aligned, as fresh optimizer
    states: the bounce path, unless torch happened to return a 4096-aligned address). Views at an
    odd address cannot be stored (the store resizes storages): the ops get those directly below."""
    store = SwapStore(_config(tmp_path, engine), rank=0)
    assert store.engine == engine
    items = []
    for name, values in source.items():
        if aligned:
            tensor = torch.empty(values.numel())
            tensor.untyped_storage().resize_(0)
            store.allocate(tensor)
            if engine != "python":
                assert tensor.data_ptr() % 4096 == 0
            tensor.copy_(values)
        else:
            tensor = values.clone()
        items.append((name, tensor))
    store.evict(items)
    store.release(items)
    files = {name: (store.directory / f"{name}.swp").read_bytes() for name in source}
    store.fetch(items)
    store.wait(items)
    for name, tensor in items:
        assert torch.equal(tensor, source[name]), (engine, name, aligned)
        if engine != "python":  # read back into the store's memory: aligned, the no-bounce path
            assert tensor.data_ptr() % 4096 == 0
    store.close(bring_back=False)
    return files


@needs_uring
@needs_compiled
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_io_uring_matches_threads_and_python_bit_exactly(tmp_path, aligned):
    torch.manual_seed(0)
    source = {f"t{n}": torch.randn(n) for n in SIZES}
    files = {e: _round_trip(tmp_path, e, source, aligned) for e in ("io_uring", "threads", "python")}
    for name, values in source.items():
        nbytes = values.numel() * 4
        # the same on-disk format: padded to whole blocks with zeros by both compiled engines
        assert files["io_uring"][name] == files["threads"][name], name
        assert len(files["io_uring"][name]) == -(-nbytes // BLOCK) * BLOCK
        assert files["io_uring"][name][nbytes:] == b"\0" * (len(files["io_uring"][name]) - nbytes)
        assert files["io_uring"][name][:nbytes] == files["python"][name] == values.numpy().tobytes()


@needs_uring
@needs_compiled
@pytest.mark.parametrize("n", SIZES)
def test_engines_read_each_others_files_at_odd_addresses(tmp_path, n):
    # The ops on their own, from and into views 4 bytes past an allocation (every block bounced
    # under O_DIRECT); one file written by each compiled engine, read by the other: one format.
    values = torch.randn(n)
    paths = {}
    for engine, op in (
        ("io_uring", torch.ops.lightning_zero.swap_uring),
        ("threads", torch.ops.lightning_zero.swap_io),
    ):
        paths[engine] = str(tmp_path / f"{engine}.swp")
        op(_unaligned(n).copy_(values), paths[engine], True, BLOCK, 4, True)
    assert Path(paths["io_uring"]).read_bytes() == Path(paths["threads"]).read_bytes()
    out = _unaligned(n)
    torch.ops.lightning_zero.swap_uring(out, paths["threads"], False, BLOCK, 4, True)
    assert torch.equal(out, values)
    out.zero_()
    torch.ops.lightning_zero.swap_io(out, paths["io_uring"], False, BLOCK, 2, True)
    assert torch.equal(out, values)


@needs_uring
@needs_compiled
def test_io_uring_errors_name_the_file_and_errno(tmp_path):
    missing = tmp_path / "absent" / "x.swp"
    with pytest.raises(RuntimeError, match=f"cannot open {missing}: No such file or directory"):
        torch.ops.lightning_zero.swap_uring(torch.empty(100), str(missing), False, BLOCK, 4, True)
    # a file shorter than the tensor: the reads past its end come back short
    path = tmp_path / "short.swp"
    torch.ops.lightning_zero.swap_uring(torch.randn(3 * 4096), str(path), True, BLOCK, 4, True)
    os.truncate(path, BLOCK)
    with pytest.raises(RuntimeError, match=f"reading {path} failed: Input/output error"):
        torch.ops.lightning_zero.swap_uring(torch.empty(3 * 4096), str(path), False, BLOCK, 4, True)
    # the ring survives a failed request: the next call on this thread works
    torch.ops.lightning_zero.swap_uring(torch.empty(4096), str(path), False, BLOCK, 4, True)


def test_unavailable_io_uring_falls_back_to_threads_with_one_warning(tmp_path, monkeypatch):
    # What a seccomp filter that blocks io_uring_setup looks like to the store (the probe's reason).
    monkeypatch.setattr(nvme, "io_uring_probe", lambda depth: "io_uring_setup: Operation not permitted")
    monkeypatch.setattr(nvme, "_warned", set())
    expected_engine = "threads" if nvme.compiled_engine() else "python"
    with pytest.warns(RuntimeWarning, match=r"aio_engine='io_uring' is not available here \(io_uring_setup: Oper"):
        store = SwapStore(_config(tmp_path, "io_uring"), rank=0)
    assert store.engine == expected_engine
    tensor = torch.randn(278011)
    expected = tensor.clone()
    store.evict([("t", tensor)])
    store.release([("t", tensor)])
    store.fetch_all()
    assert torch.equal(tensor, expected)
    store.close(bring_back=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        SwapStore(_config(tmp_path, "io_uring"), rank=1).close(bring_back=False)
        # "auto" falls back without a warning when the thread engine is there: it asked for the best available
        if nvme.compiled_engine():
            assert SwapStore(_config(tmp_path, "auto"), rank=2).engine == "threads"


@needs_uring
def test_auto_picks_io_uring_when_it_works(tmp_path):
    store = SwapStore(_config(tmp_path, "auto"), rank=0)
    assert store.engine == "io_uring"
    store.close(bring_back=False)


def test_python_engine_allocates_with_torch(tmp_path):
    # The reference engine goes through the page cache: no alignment needed, torch's allocator.
    store = SwapStore(_config(tmp_path, "python"), rank=0)
    tensor = torch.empty(0)
    store.allocate(tensor)
    assert tensor.untyped_storage().nbytes() == 0
    store.close(bring_back=False)
