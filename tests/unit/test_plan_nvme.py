"""The NVMe tiers in the plan (:mod:`lightning_zero.plan.disk`), beyond the 2-rank equality with a
real run (tests/distributed/test_plan_nvme.py): the step-time replay of the disk's reads and writes
(read-ahead and write-behind overlap compute, a blocking read does not), an accelerator's plan, the
swap files at 1,024 ranks against the tiers' formulas, ``--search`` and the command. Structure, not
a disk's speed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lightning_zero.config import NvmeConfig, OffloadConfig, ZeroConfig
from lightning_zero.plan import plan
from lightning_zero.plan.machine import NVME, Link, Machine, known
from lightning_zero.plan.timing import step_time

# round rates: 1 GB/s reads, 0.5 GB/s writes, 1 GFLOP/s, so the seconds below are exact
DISK = Machine(
    name="disk",
    flops={"float32": 1e9},
    memory_bandwidth=1e9,
    collectives={"all_reduce": Link(latency=0.0, bandwidth=1e9)},
    op_overhead=0.0,
    nvme_read=1e9,
    nvme_write=5e8,
)
OP = ("op", "device", "float32", 10**9, 0)  # 1 s of compute


@pytest.fixture(autouse=True)
def _no_process_group():
    """The planner makes its own fake process group: none may be left by an earlier test."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _stack_plan(device: str, **nvme: int):  # noqa: ANN003, ANN202
    return plan(
        "tests.unit.test_plan_time:Stack",
        4,
        zero=ZeroConfig(stage=3, reduce_bucket_size=5000, param_persistence_threshold=10),
        offload=OffloadConfig(
            offload_optimizer="nvme", offload_parameters="nvme", nvme=NvmeConfig(path="unused", **nvme)
        ),
        device=device,
        precision="bf16-mixed",
        inputs=[((9, 67), torch.float32)],
    )


def test_reads_ahead_and_writes_behind_overlap_compute():
    read = ("io", "read", 10**9, 1)  # 1 s at 1 GB/s
    ahead = step_time([read, OP, ("io_wait", 1)], [], 1, DISK)
    assert ahead.seconds == pytest.approx(1.0) and ahead.disk == pytest.approx(1.0) and ahead.exposed_disk == 0
    blocking = step_time([read, ("io_wait", 1), OP], [], 1, DISK)
    assert blocking.seconds == pytest.approx(2.0) and blocking.exposed_disk == pytest.approx(1.0)
    # a write of 1 s (5e8 bytes at 0.5 GB/s) behind 1 s of compute, then a read: the directions queue apart
    behind = step_time([("io", "write", 5 * 10**8, 2), ("io", "read", 10**9, 3), OP, ("io_wait", 3)], [], 1, DISK)
    assert behind.seconds == pytest.approx(1.0) and behind.disk == pytest.approx(2.0)
    # two reads queue on the one direction: the second ends at 2 s, half a second after 1.5 s of compute
    queued = step_time([read, ("io", "read", 10**9, 4), OP, ("op", "device", "float32", 5 * 10**8, 0), ("io_wait", 4)], [], 1, DISK)  # fmt: skip
    assert queued.seconds == pytest.approx(2.0) and queued.exposed_disk == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no NVMe read rate"):
        step_time([read], [], 1, dataclasses.replace(DISK, nvme_read=0.0))
    with pytest.raises(ValueError, match="rate must be positive"):
        dataclasses.replace(DISK, nvme_write=-1.0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_engine_reads_parameters_ahead_of_their_gathers(device):
    p = _stack_plan(device, param_buffer_count=2, block_size=4096)
    assert p.nvme is not None and p.nvme_bytes == sum(p.nvme.files.values()) > 0
    names = set(p.nvme.files)
    assert any(n.startswith("param") for n in names) and any(n.endswith("exp_avg_sq") for n in names)
    # a CPU rank's reduced gradient slices rest on disk too; an accelerator keeps them on the device
    assert any(n.startswith("grad") for n in names) == (device == "cpu")
    assert all(size % 4096 == 0 for size in p.nvme.files.values())  # the compiled engines' whole blocks
    # between steps the tiers hold no memory: masters, moments (and parameter shards) are on disk
    for where in ("device", "host"):
        assert p.memory[where]["master_weights"] == 0
    assert p.nvme.staging_bytes > 0 and p.nvme.read_per_step > 0 and p.nvme.written_per_step > 0
    t = p.step_time(DISK)
    assert 0 < t.exposed_disk < t.disk  # some reads run under compute (read-ahead, the step's window)
    slower = p.step_time(dataclasses.replace(DISK, nvme_read=1e7, nvme_write=1e7))
    assert slower.seconds > t.seconds and slower.disk > t.disk
    # the step's window: buffer_count sub-groups read ahead and written behind at once
    narrow, wide = (_stack_plan(device, buffer_count=n, block_size=4096).nvme for n in (2, 8))
    assert narrow.staging_bytes < wide.staging_bytes and narrow.read_per_step == wide.read_per_step


def test_the_swap_files_at_1024_ranks_follow_the_tiers_formulas(tmp_path):
    import transformers  # noqa: F401  (the test extra installs it)

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 5000}))
    n, block = 1024, 4096
    offload = OffloadConfig(
        offload_optimizer="nvme", offload_parameters="nvme", nvme=NvmeConfig(path="unused", block_size=block)
    )
    p = plan(str(config), n, zero=ZeroConfig(stage=3, param_persistence_threshold=0), offload=offload, seq_len=16)
    assert p.nvme is not None
    psi, files = p.numel, p.nvme.files
    # bf16-mixed Adam on an accelerator: fp32 master and two fp32 moments (12 bytes) and the bf16
    # shard (2 bytes) per element of the rank's slice, each file padded to whole blocks
    low = 14 * psi / n
    assert low <= p.nvme_bytes <= low + block * len(files)
    assert p.nvme.read_per_step >= 12 * psi / n  # the step reads every master and moment once


def test_search_tries_the_nvme_tiers_given_nvme_bytes():
    from lightning_zero.plan.search import format_search, search

    kwargs = {"micro_batches": (1,), "make_inputs": lambda mb: [((mb, 67), torch.float32)], "device": "cpu"}
    without = search("tests.unit.test_plan_time:Stack", 4, DISK, device_memory=2**30, host_memory=2**30, **kwargs)
    assert all(c.plan.nvme is None for c in without)
    found = search(
        "tests.unit.test_plan_time:Stack", 4, DISK, device_memory=2**30, host_memory=2**30, nvme_memory=2**30, **kwargs
    )
    disk = [c for c in found if c.plan.nvme is not None]
    assert len(disk) == 3 and all(c.fits for c in disk) and "optimizer:nvme+parameters:nvme" in format_search(found)
    tight = search(
        "tests.unit.test_plan_time:Stack", 4, DISK, device_memory=2**30, host_memory=2**30, nvme_memory=1, **kwargs
    )
    assert all(not c.fits for c in tight if c.plan.nvme is not None) and tight[0].fits


def test_the_plan_command_plans_the_nvme_tiers(capsys):
    from lightning_zero.cli import main

    args = ["plan", "tests.unit.test_plan_time:Stack", "--world-size", "4", "--input", "3,67", "--stage", "3"]
    disk = ["--offload-optimizer", "nvme", "--offload-parameters", "nvme"]
    assert main([*args, *disk, "--machine", "H100"]) == 0
    out = capsys.readouterr().out
    assert "NVMe: " in out and "swap files" in out and "; NVMe " in out
    assert main([*args, *disk, "--nvme", "1e-6"]) == 1  # 1 KiB per rank: the files do not fit
    assert "more than --nvme" in capsys.readouterr().err
    assert main([*args, "--offload-optimizer", "--offload-parameters"]) == 0  # no value: host memory, as before
    assert "NVMe: " not in capsys.readouterr().out
    assert main([*args, "--search", "--machine", "H100", "--micro-batches", "1", "--nvme", "1"]) == 0
    assert "optimizer:nvme" in capsys.readouterr().out
    assert main([*args, "--device", "cpu", *disk, "--machine", "calibrate"]) == 2  # before measuring anything
    assert "--nvme-path" in capsys.readouterr().err
    assert known("H100").nvme_read == NVME["read"] and known("A100").nvme_write == NVME["write"]


def test_measure_disk_times_the_stores_own_reads_and_writes(tmp_path):
    from lightning_zero.plan.disk import measure_disk

    read, write = measure_disk(str(tmp_path), seconds=0.1, nbytes=4 << 20)
    assert read > 0 and write > 0
    assert list(tmp_path.iterdir()) == []  # the probe's directory and files are gone
