"""The disk tier's pieces on their own (:mod:`lightning_zero.offload.nvme`): swap files round
trip exactly, free-space and stale-directory checks, cleanup. The training parity is in
tests/distributed/test_nvme.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from lightning_zero.config import NvmeConfig
from lightning_zero.offload import nvme
from lightning_zero.offload.nvme import MARKER, SwapStore, check_free_space, claim_directory, rank_directory

ENGINES = [
    "python",
    pytest.param(
        "threads",
        marks=pytest.mark.skipif(not nvme.compiled_engine(), reason="lightning_zero._C not built with swap_io"),
    ),
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(
            nvme.io_uring_probe(8) is not None, reason=f"io_uring unavailable here: {nvme.io_uring_probe(8)}"
        ),
    ),
]


def _config(tmp_path, **knobs) -> NvmeConfig:
    return NvmeConfig(path=str(tmp_path / "swap"), **knobs)


@pytest.mark.parametrize("engine", ENGINES)
def test_swap_round_trip_is_exact_and_frees_memory(tmp_path, engine):
    # 278011 elements (odd, as the kernels' tests) over 4 KiB requests: the last request is partial.
    store = SwapStore(_config(tmp_path, block_size=4096, threads=3), rank=0, engine=engine)
    tensors = {"a": torch.randn(278011), "b": torch.randn(7, dtype=torch.float64).reshape(-1)}
    expected = {k: v.clone() for k, v in tensors.items()}
    items = list(tensors.items())
    store.evict(items)
    store.release(items)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    # the compiled engines pad each file to whole blocks (O_DIRECT), the Python one does not
    padded = -(-278011 * 4 // 4096) * 4096 if engine != "python" else 278011 * 4
    assert os.path.getsize(store.directory / "a.swp") == padded
    store.fetch(items)
    store.wait(items)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name  # bytes in, bytes out
    assert store.bytes_read == store.bytes_written == 278011 * 4 + 7 * 8
    store.close(bring_back=False)
    assert not store.directory.exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_busy_time_is_the_union_of_each_directions_running_requests(tmp_path, engine):
    """``SwapStore.busy`` (benchmarks/capacity.py's rates while running): seconds with at least one
    request of a direction on a worker. Three tensors written, then read, three workers each: the
    requests overlap, so a sum of their times could exceed the wall time; the union cannot."""
    import time

    store = SwapStore(_config(tmp_path, block_size=4096, threads=3), rank=0, engine=engine)
    items = [(f"t{i}", torch.randn(1 << 20)) for i in range(3)]
    start = time.perf_counter()
    store.evict(items)
    store.release(items)
    written = time.perf_counter() - start
    start = time.perf_counter()
    store.fetch(items)
    store.wait(items)
    read = time.perf_counter() - start
    assert 0 < store.busy["write"] <= written and 0 < store.busy["read"] <= read, (store.busy, written, read)
    store.close(bring_back=False)


@pytest.mark.parametrize("engine", ENGINES)
def test_rename_hands_a_written_file_to_its_owner(tmp_path, engine):
    # The sharded build writes a master before its optimizer exists (BuildToDisk); the tier that
    # takes it over later reads it under its own name.
    store = SwapStore(_config(tmp_path, block_size=4096), rank=0, engine=engine)
    tensor = torch.randn(5003)
    expected = tensor.clone()
    store.evict([("build0.master", tensor)])
    store.release([("build0.master", tensor)])
    store.rename(tensor, "0.master")
    assert not (store.directory / "build0.master.swp").exists()
    store.fetch([("0.master", tensor)])
    store.wait([("0.master", tensor)])
    assert torch.equal(tensor, expected)
    store.close(bring_back=False)


def test_python_engine_is_the_fallback_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "compiled_engine", lambda: False)
    monkeypatch.setattr(nvme, "io_uring_probe", lambda depth: "not built")
    monkeypatch.setattr(nvme, "_warned", set())
    with pytest.warns(RuntimeWarning, match="compiled I/O engine is not available"):
        store = SwapStore(_config(tmp_path), rank=0)
    assert store.engine == "python"
    tensor = torch.randn(5000)
    expected = tensor.clone()
    store.evict([("t", tensor)])
    store.release([("t", tensor)])
    store.fetch_all()
    assert torch.equal(tensor, expected)
    store.close(bring_back=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second store does not warn again
        SwapStore(_config(tmp_path), rank=1).close(bring_back=False)


def test_close_brings_states_back_before_removing_files(tmp_path):
    store = SwapStore(_config(tmp_path), rank=3)
    tensor = torch.arange(1000, dtype=torch.float32)
    store.evict([("x", tensor)])
    store.release([("x", tensor)])
    store.close(bring_back=True)
    assert torch.equal(tensor, torch.arange(1000, dtype=torch.float32))
    assert not rank_directory(_config(tmp_path), 3).exists()


def test_free_space_error_names_both_numbers(tmp_path):
    config = _config(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    check_free_space(config, free // 2)  # fits: no error (the directory does not exist yet either)
    needed = free + 10 * 2**30
    with pytest.raises(ValueError, match=rf"writes {needed} bytes .* only \d+ bytes .* are free"):
        check_free_space(config, needed)


def test_stale_directory_of_a_dead_run_is_removed(tmp_path):
    directory = tmp_path / "lightning_zero-rank0"
    directory.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is no longer alive (the kernel does not reuse it this fast)
    (directory / MARKER).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    (directory / "0.master.swp").write_bytes(b"\0" * 100)
    with pytest.warns(UserWarning, match="stale swap directory"):
        claim_directory(directory)
    assert sorted(p.name for p in directory.iterdir()) == [MARKER]
    assert json.loads((directory / MARKER).read_text())["pid"] == os.getpid()


def test_directory_of_a_live_run_is_an_error(tmp_path):
    directory = tmp_path / "lightning_zero-rank0"
    directory.mkdir()
    (directory / MARKER).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(ValueError, match=f"in use by process {os.getppid()}"):
        claim_directory(directory)
    assert (directory / MARKER).exists()  # left alone


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"block_size": 3000}, "block_size=3000 must be an integer from 4096"),
        ({"block_size": 12288}, "must be a power of two"),
        ({"queue_depth": 0}, "queue_depth=0"),
        ({"threads": 65}, "threads=65 must be an integer from 1 to 64"),
        ({"buffer_count": 1}, "buffer_count=1 must be an integer from 2"),
        ({"param_buffer_count": 0}, "param_buffer_count=0 must be an integer from 1 to 64"),
        ({"restore_after_fit": "no"}, "restore_after_fit=.no. must be True, False or None"),
        ({"aio_engine": "libaio"}, r"aio_engine='libaio' must be one of \['auto', 'io_uring', 'threads', 'python'\]"),
    ],
)
def test_invalid_knobs(tmp_path, knobs, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **knobs)


def test_strategy_options():
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match="need nvme_path"):
        ZeroStrategy(offload_optimizer="nvme")
    with pytest.raises(ValueError, match="'cpu' .* or 'nvme'"):
        ZeroStrategy(offload_optimizer="disk")
    with pytest.raises(ValueError, match="unknown keys \\['depth'\\]"):
        ZeroStrategy(offload_optimizer="nvme", nvme_path="/tmp", nvme_config={"depth": 4})
    with pytest.raises(ValueError, match="set offload_optimizer='nvme'"):
        ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters="nvme", nvme_path="/tmp")
    with pytest.raises(ValueError, match="needs stage=3"):
        ZeroStrategy(stage=2, offload_optimizer="nvme", offload_parameters="nvme", nvme_path="/tmp")
    on_disk = ZeroStrategy(stage=3, offload_optimizer="nvme", offload_parameters="nvme", nvme_path="/tmp")
    assert on_disk.precision_plugin.offload.parameter_tier == "nvme"
    strategy = ZeroStrategy(offload_optimizer="nvme", nvme_path="/tmp", nvme_config={"threads": 3})
    assert strategy.precision_plugin.offload.optimizer_tier == "nvme"
    assert strategy.precision_plugin.offload.nvme == NvmeConfig(path="/tmp", threads=3)
    assert ZeroStrategy(offload_optimizer="cpu").precision_plugin.offload.optimizer_tier == "cpu"


def test_two_stores_of_one_rank_in_one_process_do_not_share_files(tmp_path):
    # Two strategies (engines) alive at once in one process, same nvme_path and rank: each store gets
    # its own directory, so the same tensor name ("opt0.0.master") in both is two files.
    config = _config(tmp_path, block_size=4096)
    first, second = SwapStore(config, rank=0), SwapStore(config, rank=0)
    assert first.directory == rank_directory(config, 0) and second.directory != first.directory
    a, b = torch.randn(1001), torch.randn(1001)
    expected = {"a": a.clone(), "b": b.clone()}
    first.evict([("opt0.0.master", a)])
    second.evict([("opt0.0.master", b)])
    for store, tensor in ((first, a), (second, b)):
        store.release([("opt0.0.master", tensor)])
    for store, tensor, key in ((first, a, "a"), (second, b, "b")):
        store.fetch([("opt0.0.master", tensor)])
        store.wait([("opt0.0.master", tensor)])
        assert torch.equal(tensor, expected[key]), key  # exact: bytes written, bytes read back
    first.close(bring_back=False)
    assert not first.directory.exists() and second.directory.exists()  # closing one leaves the other
    third = SwapStore(config, rank=0)  # the freed name is taken again
    assert third.directory == rank_directory(config, 0)
    for store in (second, third):
        store.close(bring_back=False)
    assert not list((tmp_path / "swap").iterdir())
