"""What a run does when something fails: a rank that died, a collective that timed out, memory.

**A lost rank.** Every rank writes ``host pid`` into the rendezvous store (the ``TCPStore`` that
``init_process_group`` made) when the process group starts (:func:`register_rank`). When a rank
dies (crash, ``kill -9``, the kernel's OOM killer), its TCP connections close and gloo raises on
every rank that talks to it at once ("Connection reset by peer" / "Connection closed by peer";
measured on 2 CPU ranks: the survivor raised within 0.1 s of the ``SIGKILL``, under Lightning's
launcher and under ``torchrun``). NCCL does not see closed sockets: there the collective ``timeout``
and NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set by :func:`set_nccl_defaults` on NCCL
when absent, and put back at teardown) end the wait and tear the process down. A silent loss (a host powered off, a network
partition) also ends at the timeout, on either backend.

A survivor then names the lost rank (:func:`lost_rank_message`): a rank on this host is gone when
its process no longer exists or is a zombie (``/proc``); a rank on another host is gone when it
does not answer in the store within a few seconds (every survivor announces itself there). When the
store itself no longer answers, the process that hosted it is gone: rank 0 under Lightning's
launcher or a plain ``env://`` rendezvous, the torchrun agent under ``torchrun``.

**Out of memory.** :func:`oom_message` adds this rank's :func:`~lightning_zero.memory.memory_breakdown`
and the settings that lower it to the error.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import subprocess
import time
from datetime import timedelta
from typing import Any, Literal

import torch

from lightning_zero import comm
from lightning_zero.config import ZeroConfig

_RANK_KEY = "lightning_zero/rank/{}"
_ANSWER_KEY = "lightning_zero/answered/{}"
#: How long a survivor waits for ranks on other hosts to announce themselves in the store.
ANSWER_GRACE = timedelta(seconds=5)
#: How long a survivor looks for a rank on this host to show up as exited in /proc.
LOCAL_GRACE_S = 2.0

# Messages of gloo, NCCL and the store when a peer is gone or a collective timed out.
_COMM_ERROR = re.compile(
    r"Connection (reset|closed) by peer|Read error|Write error|Broken pipe|Socket Timeout|"
    r"Timed out waiting|timed out|NCCL communicator was aborted|Connection was likely closed|"
    r"ProcessGroup\w* .*(abort|timeout)",
    re.IGNORECASE,
)
_OOM = re.compile(r"out of memory|DefaultCPUAllocator: can't allocate|CUDA error: out of memory", re.IGNORECASE)


#: Environment variables :func:`set_nccl_defaults` may set, with the value it sets.
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def set_nccl_defaults(backend: str) -> dict[str, str | None]:
    """Before ``init_process_group`` on an NCCL ``backend``: let NCCL's watchdog tear the process
    down when a collective fails or times out, unless the user chose otherwise (torch's default since
    2.2; older releases would otherwise block forever on a dead peer). Nothing on other backends.
    Returns the variables' previous values (``None``: unset) for :func:`restore_environment`, so
    that a strategy leaves the process environment as it found it."""
    if "nccl" not in backend.lower():
        return {}
    before = {name: os.environ.get(name) for name in NCCL_DEFAULTS}
    for name, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return before


def restore_environment(before: dict[str, str | None]) -> None:
    """Put back the variables :func:`set_nccl_defaults` found (unset those that were unset)."""
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


#: ``{rank: (host, pid)}`` of every rank of a run, as :func:`register_rank` returned it.
Processes = dict[int, tuple[str, int]]


def _destroy_groups() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


_exit_hook: list[bool] = []  # registered once per process


def register_rank(rank: int, world_size: int, timeout: timedelta) -> Processes:
    """Write this process's host and pid into the rendezvous store and read every rank's (kept, so
    that naming a lost rank later needs no store when the rank ran on this host). Call on every rank
    after the default process group exists.

    Also registers, once per process, an exit hook that destroys the process groups still alive
    when the interpreter exits (Lightning leaves the default group up after fit). Without it a rank
    of a two-process gloo job under this strategy aborted at exit in 2 of 8 torchrun runs here
    ("terminate called without an active exception", exit -6: the job fails after training
    finished; plain DDP: 0 of 8), and tests/distributed/test_launchers.py failed 5 of 12 times;
    with it, 0 of 10 each. A script that destroys the group itself is unaffected."""
    store = comm.default_store()
    if store is None or world_size <= 1:
        return {}
    if not _exit_hook:
        atexit.register(_destroy_groups)
        _exit_hook.append(True)
    store.set(_RANK_KEY.format(rank), f"{socket.gethostname()} {os.getpid()}")
    keys = [_RANK_KEY.format(r) for r in range(world_size)]
    store.wait(keys, timeout)
    processes: Processes = {}
    for r, key in enumerate(keys):
        host, pid = store.get(key).decode().rsplit(" ", 1)
        processes[r] = (host, int(pid))
    return processes


def is_communication_error(error: BaseException) -> bool:
    """A collective or the store failed because a peer vanished or did not answer in time."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error)
    from_backend = any(name in text for name in ("gloo", "NCCL", "c10d", "ProcessGroup"))
    return isinstance(error, RuntimeError) and from_backend and bool(_COMM_ERROR.search(text))


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError`` or an allocator's "out of memory" RuntimeError (CPU or device)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and bool(_OOM.search(str(error)))
    )


def _process_state(pid: int) -> str | None:
    """The state letter of ``pid`` from /proc (``None``: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _local_verdict(host: str, pid: int) -> bool | None:
    """True: gone; False: running; None: on another host (cannot tell from here)."""
    if host != socket.gethostname() or not os.path.isdir("/proc"):
        return None
    state = _process_state(pid)
    return state is None or state in ("Z", "X")  # a zombie has exited, its parent just has not reaped it


def _silent_ranks(rank: int, candidates: list[int], grace: timedelta) -> list[int] | None:
    """Of ``candidates``, the ranks that do not announce this failure in the store within ``grace``
    (every survivor announces itself); ``None`` when the store does not answer."""
    store = comm.default_store()
    if store is None:
        return None
    try:
        store.set_timeout(grace)  # the process is going down: no store call may block for long
        answered = store.add(_ANSWER_KEY.format(rank), 1)  # failures this rank has announced
        deadline = time.monotonic() + grace.total_seconds()
        while candidates and time.monotonic() < deadline:
            candidates = [r for r in candidates if store.add(_ANSWER_KEY.format(r), 0) < answered]
            if candidates:
                time.sleep(0.2)
        return candidates
    except Exception:  # noqa: BLE001 - DistNetworkError and friends: the store's host is gone
        return None


def find_lost_ranks(rank: int, processes: Processes, grace: timedelta = ANSWER_GRACE) -> dict[int, str]:
    """``{lost rank: why}`` as surviving rank ``rank`` sees it, within about ``grace`` (only ranks on
    other hosts are waited for; ranks on this host are looked up in /proc)."""
    lost: dict[int, str] = {}
    remote = [r for r, (host, pid) in processes.items() if r != rank and _local_verdict(host, pid) is None]
    local = [r for r in processes if r != rank and r not in remote]
    # A killed process closes its sockets while it exits, so the collective may fail a moment before
    # /proc shows it gone: look again for a short while before calling a local rank alive.
    deadline = time.monotonic() + LOCAL_GRACE_S
    while True:
        for other in local:
            host, pid = processes[other]
            if other not in lost and _local_verdict(host, pid):
                lost[other] = f"pid {pid} on {host} exited"
        if lost or not local or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not remote:
        return lost
    silent = _silent_ranks(rank, remote, grace)
    if silent is None:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            why = f"the rendezvous store at {address}, torchrun's agent on the first node, does not answer"
            lost.update({r: why for r in remote if processes[r][0] == processes[0][0]})
        elif 0 in remote:
            lost[0] = f"the rendezvous store at {address} that rank 0 hosted does not answer"
        return lost
    for other in silent:
        host, pid = processes[other]
        lost[other] = f"pid {pid} on {host} did not answer within {grace.total_seconds():.0f} s"
    return lost


def lost_rank_message(
    error: BaseException, rank: int, world_size: int, processes: Processes, last_gathered: str | None = None
) -> str | None:
    """The error text naming the lost rank(s), or ``None`` if ``error`` is not a communication
    failure. ``last_gathered``: under stage 3, the module this rank gathered last (ranks that took
    different branches stop in different modules). Call on a rank whose collective just failed."""
    if world_size <= 1 or not is_communication_error(error):
        return None
    lost = find_lost_ranks(rank, processes)
    below = f"(the collective that failed on rank {rank} is below)"
    if not lost:
        stage3 = (
            f" Under stage 3 every rank must run the same modules: this rank last gathered {last_gathered}; a "
            "branch taken on some ranks only (an early exit, HF generate() stopping at EOS on one rank: pass "
            "synced_gpus=True) ends like this."
            if last_gathered
            else ""
        )
        return (
            f"a collective failed on rank {rank}, but no rank of {world_size} is known to be gone: stopping {below}. "
            "A rank that is alive but stuck (or a collective timeout too short for a slow step) looks like this; "
            "raise ZeroStrategy(timeout=...), or run with debug_collectives=True to find a mismatched collective."
            + stage3
        )
    names = ", ".join(f"rank {r} of {world_size} is gone ({why})" for r, why in sorted(lost.items()))
    return f"{names}: stopping {below}. Look for the first error in the log of the lost rank."


def _quarter(name: str, value: int | str) -> str:
    """``name=<a quarter of value> (now value)``; an unresolved ``"auto"`` counts as its largest size."""
    from lightning_zero.config import AUTO_BUCKET_MAX

    size = AUTO_BUCKET_MAX if isinstance(value, str) else value
    now = f"{value!r}, at most {AUTO_BUCKET_MAX:_}" if isinstance(value, str) else f"{value:_}"
    return f"{name}={max(size // 4, 1):_} (now {now})"


#: The first setting to try against an out-of-memory error, as each API accumulates gradients: the
#: Trainer by its argument, a Fabric program in its own loop.
SMALLER_MICRO_BATCH = {
    "trainer": "a smaller micro-batch with Trainer(accumulate_grad_batches=...) to keep the global batch;",
    "fabric": "a smaller micro-batch, accumulating its gradients over several fabric.backward() calls (inside "
    "fabric.no_backward_sync) before each optimizer.step(), to keep the global batch;",
}


def oom_message(
    error: BaseException,
    breakdown: dict[str, dict[str, int]] | None,
    config: ZeroConfig,
    registered: list[str],
    *,
    api: Literal["trainer", "fabric"],
) -> str:
    """The text to put in front of an out-of-memory error: what this rank holds and what to try.

    ``config`` is the strategy's :class:`~lightning_zero.config.ZeroConfig`; ``registered`` the
    strategy names Lightning knows (offload is only suggested when it exists); ``api``: ``"trainer"``
    or ``"fabric"``, whose way of accumulating gradients the advice names (:data:`SMALLER_MICRO_BATCH`)."""
    lines = ["Out of memory during a ZeRO step."]
    if breakdown is not None:
        for where, categories in breakdown.items():
            used = {k: v for k, v in categories.items() if v}
            if used:
                parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in used.items())
                lines.append(f"This rank holds on {where}: {parts} (total {sum(used.values()) / 2**20:.1f} MiB).")
    lines.append("Settings to try, cheapest first:")
    lines.append(f"- {SMALLER_MICRO_BATCH[api]}")
    lines.append(f"- {_quarter('reduce_bucket_size', config.reduce_bucket_size)}: smaller gradient buckets;")
    if config.stage == 3:
        lines.append(
            f"- {_quarter('prefetch_bucket_size', config.prefetch_bucket_size)} "
            f"and max_live_parameters={max(config.max_live_parameters // 4, 1):_}: fewer gathered parameters at once;"
        )
    else:
        lines.append(
            f"- stage={config.stage + 1} (now {config.stage}): shard {'gradients' if config.stage == 1 else 'parameters'} too;"
        )
    offload = [name for name in registered if name.startswith(f"zero{config.stage}_offload") or name == "zero3_offload"]
    if offload:
        lines.append(f"- strategy={offload[0]!r}: fp32 master weights and optimizer states in CPU memory;")
    lines.append("- activation checkpointing (torch.utils.checkpoint) in the largest blocks.")
    return "\n".join(lines)


def replace_message(error: BaseException, text: str) -> None:
    """Put ``text`` in front of ``error``'s message, in place: Lightning re-raises the same object."""
    original = str(error)
    error.args = (f"{text}\n{type(error).__name__}: {original}" if original else text, *error.args[1:])


def reap_children_at_exit(launcher: Any, grace: float = 5.0) -> None:
    """Under Lightning's own launcher this process started the other ranks: at exit, give them
    ``grace`` seconds to stop on their own (a gloo peer fails as soon as this process is gone), then
    kill them, so that no rank outlives a failed run (one stuck outside a collective, or in an NCCL
    collective that would wait for the timeout)."""
    procs = getattr(launcher, "procs", None)
    if not procs:
        return

    def reap() -> None:
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    atexit.register(reap)
