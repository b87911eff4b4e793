"""Spawn CPU/gloo ranks that look to Lightning as if ``torchrun`` had started them.

Each rank gets the torchelastic environment variables, so Lightning's ``TorchElasticEnvironment``
is detected and no launcher of Lightning's own starts extra processes; several Trainers can then run
one after the other in the same ranks (the DDP reference and the ZeRO runs) over one process group.
A worker returns a picklable result; ``run_ranks`` returns the list of results in rank order and
re-raises the first failure with the rank's traceback.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        NODE_RANK="0",
        TORCHELASTIC_RUN_ID="lightning_zero_tests",
        OMP_NUM_THREADS="1",
    )
    import torch

    # Two ranks share two cores: one thread each avoids oversubscription (and its timing noise).
    torch.set_num_threads(1)
    try:
        # Serialized to bytes: tensors sent through a torch queue would be shared through file
        # descriptors that vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned ranks; results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        if not queue.empty():
            rank, status, payload = queue.get()
            (results.__setitem__(rank, payload) if status == "ok" else errors.append(f"rank {rank}:\n{payload}"))
            if errors:
                break
        elif not any(p.is_alive() for p in procs) and queue.empty():
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if not errors else 1)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise AssertionError("a rank failed:\n" + errors[0])
    if len(results) < world_size:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"ranks ended without a result (exit codes {codes}) or timed out after {timeout}s")
    import torch

    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
