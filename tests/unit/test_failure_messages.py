"""The pieces of lightning_zero.failures that need no process group: which errors count as a lost
peer or as out of memory, how a lost rank is found from its host and pid, and the OOM advice."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

from lightning_zero import failures
from lightning_zero.config import ZeroConfig

GLOO_RESET = RuntimeError(
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7843: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def test_error_kinds():
    assert failures.is_communication_error(GLOO_RESET)
    assert not failures.is_communication_error(RuntimeError("Connection reset by peer"))  # not from a backend
    assert not failures.is_communication_error(ValueError("gloo Read error"))
    assert failures.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert failures.is_out_of_memory(
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
    )
    assert not failures.is_out_of_memory(RuntimeError("shape mismatch"))


def test_local_rank_gone_is_named():
    here = socket.gethostname()
    processes = {0: (here, os.getpid()), 1: (here, _dead_pid()), 2: (here, os.getpid())}
    message = failures.lost_rank_message(GLOO_RESET, 0, 3, processes)
    assert message is not None and message.startswith(f"rank 1 of 3 is gone (pid {processes[1][1]} on {here} exited)")
    assert "rank 2" not in message
    assert failures.lost_rank_message(RuntimeError("a bug"), 0, 3, processes) is None


def test_store_host_gone_is_named(monkeypatch):
    # Rank 0 on another host and no store to ask (as when rank 0, which hosted it, died). An earlier
    # test in this process may have left a default process group, and so a store: hide it.
    monkeypatch.setattr(failures.comm, "default_store", lambda: None)
    processes = {0: ("another-host", 1234), 1: (socket.gethostname(), os.getpid())}
    lost = failures.find_lost_ranks(1, processes)
    assert list(lost) == [0] and "that rank 0 hosted does not answer" in lost[0]


def test_oom_advice_follows_the_settings():
    stage2 = failures.oom_message(
        RuntimeError("x"), {"device": {"parameters": 3 * 2**20, "gradients": 0}}, ZeroConfig(stage=2), [], api="trainer"
    )
    assert "This rank holds on device: parameters 3.0 MiB (total 3.0 MiB)." in stage2
    assert "stage=3 (now 2)" in stage2 and "prefetch_bucket_size" not in stage2 and "offload" not in stage2
    assert "reduce_bucket_size=1_250_000 (now 'auto', at most 5_000_000)" in stage2  # before the engine resolves it
    config = ZeroConfig(stage=3, reduce_bucket_size=1000, prefetch_bucket_size=400)
    stage3 = failures.oom_message(RuntimeError("x"), None, config, ["zero3", "zero3_offload"], api="fabric")
    assert "reduce_bucket_size=250 (now 1_000)" in stage3 and "prefetch_bucket_size=100 (now 400)" in stage3
    assert "strategy='zero3_offload'" in stage3 and "stage=" not in stage3
    # each API's own way of accumulating gradients
    assert "Trainer(accumulate_grad_batches=...)" in stage2 and "fabric" not in stage2
    assert "fabric.no_backward_sync" in stage3 and "Trainer" not in stage3


def test_nccl_defaults_only_on_nccl_and_restored(monkeypatch):
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    monkeypatch.delenv(name, raising=False)
    assert failures.set_nccl_defaults("gloo") == {} and name not in os.environ  # gloo: untouched
    before = failures.set_nccl_defaults("nccl")
    assert os.environ[name] == "1"
    failures.restore_environment(before)
    assert name not in os.environ  # unset again, as found
    monkeypatch.setenv(name, "0")  # the user's choice wins and survives the restore
    before = failures.set_nccl_defaults("cpu:gloo,cuda:nccl")
    assert os.environ[name] == "0"
    failures.restore_environment(before)
    assert os.environ[name] == "0"


def test_stage3_divergence_names_the_last_gathered_module():
    """No rank is gone (the other is alive in another collective): under stage 3 the message names
    the module this rank gathered last and the usual cause, HF generate() without synced_gpus."""
    processes = {0: (socket.gethostname(), os.getpid()), 1: (socket.gethostname(), os.getpid())}
    text = failures.lost_rank_message(GLOO_RESET, 0, 2, processes, "'model.layers.1.mlp' (gather 7 of its pass)")
    assert text is not None and "no rank of 2 is known to be gone" in text
    assert "last gathered 'model.layers.1.mlp' (gather 7 of its pass)" in text and "synced_gpus=True" in text
    plain = failures.lost_rank_message(GLOO_RESET, 0, 2, processes)
    assert plain is not None and "synced_gpus" not in plain  # stages 1/2: nothing gathered, nothing to name
