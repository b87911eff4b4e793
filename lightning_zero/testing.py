"""Spawn CPU/gloo ranks that look to Lightning as if ``torchrun`` had started them: the one harness
of the distributed tests and the benchmarks.

Each rank gets the torchelastic environment variables, so Lightning's ``TorchElasticEnvironment``
is detected and no launcher of Lightning's own starts extra processes; several Trainers can then run
one after the other in the same ranks (a reference and the ZeRO runs) over one process group. A
worker returns a picklable result; :func:`run_ranks` returns the results in rank order, re-raises
the first failure with the rank's traceback, and gives up after ``timeout`` seconds: a rank killed
from outside (say for memory) never reports, and without the deadline its peers would wait on it
forever.

Ranks are forked from a ``forkserver`` process that imported torch, Lightning and this package once
(where the platform has one): a freshly spawned rank spends ~5 s of CPU importing them (measured
5.4 s on the 2-core AVX2 development machine), which was most of the test suite's time. Each rank
still starts from that clean state (nothing of the parent's is inherited but what is passed), and
gets the parent's environment as it is at the call (the server's own is that of its start).
Variables read when a library loads (``OMP_*``, ``MALLOC_*``) keep their values from the server's
start; ``LIGHTNING_ZERO_TEST_START=spawn`` starts every rank afresh instead.
"""

from __future__ import annotations

import io
import os
import random
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


#: modules every forked rank finds imported (the forkserver imports them once)
PRELOAD = ["torch", "lightning.pytorch", "lightning_zero"]


def _context() -> Any:
    method = os.environ.get("LIGHTNING_ZERO_TEST_START")
    if method is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"LIGHTNING_ZERO_TEST_START={method!r} must be 'forkserver' or 'spawn'.")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # used when the server starts (once per parent process)
    return ctx


def _entry(
    rank: int,
    world_size: int,
    port: int,
    run_id: str,
    prepare: Callable[[], None] | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    environment: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environment)  # the caller's, as a spawned process would inherit it
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        NODE_RANK="0",
        TORCHELASTIC_RUN_ID=run_id,
        OMP_NUM_THREADS="1",
    )
    # Ranks share the machine's cores: one intra-op thread each avoids oversubscription (and its
    # timing noise in the benchmarks).
    torch.set_num_threads(1)
    # Forked ranks share the server's random state: draw fresh seeds, as a spawned process would.
    random.seed()
    torch.seed()
    try:
        if prepare is not None:
            prepare()
        # Serialized to bytes: tensors sent through a torch queue would be shared through file
        # descriptors that vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 240.0,
    run_id: str = "lightning_zero_tests",
    prepare: Callable[[], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned ranks; their results in rank order.

    ``fn`` (and ``prepare``, run first in every rank) must be importable by the children: a
    module-level function. Raises ``AssertionError`` when a rank fails (with its traceback), when
    ranks end without a result, or after ``timeout`` seconds; the other ranks are killed then.
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    environment = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, run_id, prepare, fn, args, queue, environment))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, bytes] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
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
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
