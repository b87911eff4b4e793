"""The NVMe tiers in the plan: the engine's own disk tier runs on meta tensors, its file I/O recorded.

``offload_optimizer="nvme"`` and ``offload_parameters="nvme"`` build the real tiers
(:class:`~lightning_zero.zero.swap.EngineSwap`, :class:`~lightning_zero.zero.swap.ParamTier`,
:class:`~lightning_zero.zero.swap_grads.GradTier`) over a :class:`RecordingStore`: a
:class:`~lightning_zero.offload.nvme.SwapStore` whose file system calls (create, rename, read, write,
close) are recorded instead of made. Every other decision is the store's and the tiers' own: which
tensors rest on disk, when each is fetched, read ahead (``buffer_count``, ``param_buffer_count``),
written behind and freed, and the size of each file (padded to ``block_size`` under the compiled
engines). So the plan reports, per rank, the swap files as the real run creates them, the host
memory the tier holds at once during a step (its staging buffers), the bytes read and written by one
step, and puts each read and write in the step-time trace (:mod:`.timing`) where the engine issues it
and where it waits for it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from lightning_zero.config import NvmeConfig, OffloadConfig
from lightning_zero.offload.nvme import Swapped, SwapStore, rank_directory

Event = tuple[Any, ...]


@dataclass(frozen=True)
class DiskPlan:
    """One rank's disk tier: its swap files and its traffic (bytes)."""

    files: dict[str, int]
    """``{file name: bytes}`` as the real run leaves them between steps (``opt0.3.exp_avg.swp``, ...)."""
    engine: str
    """The I/O engine assumed: a compiled one ("io_uring"/"threads": files padded to whole blocks)
    unless ``aio_engine="python"``."""
    staging_bytes: int
    """The most host memory the tier's tensors held at once during a step: the sub-groups read ahead
    and written behind by the optimizer step, the parameter shards read ahead of their gathers, the
    gradient slices being reduced and written (the compiled engines serve them from the store's
    aligned pool, which never holds more than this)."""
    read_per_step: int
    written_per_step: int
    setup_written: int
    """Bytes written while the engine was built (every file once)."""

    @property
    def nvme_bytes(self) -> int:
        """Bytes of this rank's swap files."""
        return sum(self.files.values())


class RecordingStore(SwapStore):
    """A :class:`SwapStore` without a file system: files, reads and writes are recorded (by the
    :class:`DiskRecorder` of the class, set by :func:`disk_tier`); the rest is the real store."""

    recorder: DiskRecorder

    def __init__(self, config: NvmeConfig, rank: int, engine: str | None = None) -> None:
        self.config = config
        requested = config.aio_engine if engine is None else engine
        # the planned machine is assumed to have the extension built (the planning one may not)
        self.engine = requested if requested in ("python", "threads") else "io_uring"
        self.directory = rank_directory(config, rank)
        self._fds: dict[str, int] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[str, list[Future], int]] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.stall = {"read": 0.0, "write": 0.0}
        self.busy = {"read": 0.0, "write": 0.0}
        self.files: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._held: dict[int, torch.Tensor] = {}  # storages given memory by allocate
        self.recorder.stores.append(self)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return self.recorder.is_host(tensor)

    def _create(self, name: str, tensor: torch.Tensor) -> int:
        self.files[name] = self.file_bytes(tensor)
        return -1

    def _move(self, old: str, name: str) -> None:
        self.files[name] = self.files.pop(old)

    def allocate(self, tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        self._held[tensor.untyped_storage()._cdata] = tensor
        self.recorder.count_staging(self)

    def staging(self) -> int:
        """Bytes the storages this store gave memory hold now."""
        return sum(t.untyped_storage().nbytes() for t in self._held.values())

    def _submit(self, name: str, tensor: torch.Tensor, write: bool) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        done: Future = Future()
        done.set_result(nbytes)
        kind = "write" if write else "read"
        self._pending[name] = (kind, [done], nbytes)
        if write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes
        self._tokens[name] = self.recorder.issue(kind, nbytes)

    def wait(self, items: Iterable[Swapped]) -> None:
        items = list(items)
        for name, _ in items:
            if name in self._pending:
                self.recorder.waited(self._tokens.pop(name))
        super().wait(items)

    def mapped(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return None  # nothing is on disk: checkpoints are not planned

    def close(self, bring_back: bool) -> None:
        if bring_back:
            self.fetch_all()
        self._pending.clear()
        self._fds.clear()
        self._tensors.clear()
        self._held.clear()


class DiskRecorder:
    """What the plan's stores did: their files, traffic and staging memory, and the trace events.

    ``host``: the plan's host allocations (``(tensor, pinned)``); ``device``: the ranks' accelerator
    ("cpu": every tensor is host memory)."""

    def __init__(self, host: list[tuple[torch.Tensor, bool]], device: str) -> None:
        self.host = host
        self.device = device
        self.stores: list[RecordingStore] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        #: the step-time trace of the step being recorded (None: not recorded)
        self.events: list[Event] | None = None
        self.staging_peak = 0
        self._token = 0
        self._known: set[int] = set()
        self._counted = 0
        self._states: set[int] = set()
        self._states_counted = -1

    def is_host(self, tensor: torch.Tensor) -> bool:
        """A CPU rank's tensors are all host memory; an accelerator's are where the engine put them:
        its host allocations, and the optimizer states it creates beside their host masters."""
        if self.device == "cpu" or tensor.device.type == "cpu":
            return True
        if self._counted != len(self.host):
            self._known = {t.untyped_storage()._cdata for t, _ in self.host}
            self._counted = len(self.host)
        key = tensor.untyped_storage()._cdata
        if key in self._known:
            return True
        if self._states_counted != sum(len(s) for o in self.optimizers for s in o.state.values()):
            states = [v for o in self.optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
            self._states = {v.untyped_storage()._cdata for v in states}
            self._states_counted = sum(len(s) for o in self.optimizers for s in o.state.values())
        return key in self._states

    def issue(self, kind: str, nbytes: int) -> int:
        self._token += 1
        if self.events is not None:
            self.events.append(("io", kind, nbytes, self._token))
        return self._token

    def waited(self, token: int) -> None:
        if self.events is not None:
            self.events.append(("io_wait", token))

    def count_staging(self, store: RecordingStore) -> None:
        self.staging_peak = max(self.staging_peak, sum(s.staging() for s in self.stores))

    def traffic(self) -> tuple[int, int]:
        """Bytes read and written so far, all stores."""
        return sum(s.bytes_read for s in self.stores), sum(s.bytes_written for s in self.stores)


@contextmanager
def disk_tier(offload: OffloadConfig, host: list[tuple[torch.Tensor, bool]], device: str) -> Iterator[DiskRecorder]:
    """The engine built in the block makes a :class:`RecordingStore` where it makes a ``SwapStore``
    (every ``lightning_zero`` module that names the class), recorded by the yielded recorder."""
    recorder = DiskRecorder(host, device)
    store = type("PlanStore", (RecordingStore,), {"recorder": recorder})
    with ExitStack() as stack:
        if offload.nvme is not None:
            import lightning_zero.zero  # noqa: F401  (every module that makes a store is loaded before the patch)

            for name, module in list(sys.modules.items()):
                if name.startswith("lightning_zero.") and getattr(module, "SwapStore", None) is SwapStore:
                    stack.enter_context(mock.patch.object(module, "SwapStore", store))
            if device == "cpu":
                # a flat buffer's host copy of its reduced gradient exists only beside an accelerator
                # (flat.py makes it with host_empty when the slice is not host memory, and the plan's
                # slices are meta): a CPU rank's gradient tier writes the slice itself
                stack.enter_context(mock.patch("lightning_zero.zero.flat.host_empty", lambda *a, **k: None))
        yield recorder


def disk_plan(recorder: DiskRecorder, before: tuple[int, int], after: tuple[int, int], setup: int) -> DiskPlan | None:
    """The report of ``recorder``'s stores; ``before``/``after``: :meth:`DiskRecorder.traffic` around
    the reported step; ``setup``: bytes written while the engine was built."""
    if not recorder.stores:
        return None
    files = {name: size for s in recorder.stores for name, size in s.files.items()}
    return DiskPlan(
        files=files,
        engine=recorder.stores[0].engine,
        staging_bytes=recorder.staging_peak,
        read_per_step=after[0] - before[0],
        written_per_step=after[1] - before[1],
        setup_written=setup,
    )


class DiskClock:
    """The disk beside the step's compute clock (:func:`.timing.step_time`): reads and writes queue
    separately (the store's two pools, and a drive serves both directions at once), each from when
    the engine issues it; the compute waits only where the engine waits (:meth:`SwapStore.wait`)."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine
        self.rates = {"read": machine.nvme_read, "write": machine.nvme_write}
        self.free = {"read": 0.0, "write": 0.0}
        self._ends: dict[int, float] = {}
        #: seconds of I/O, and seconds the compute waited for it
        self.busy = self.stalled = 0.0

    @property
    def end(self) -> float:
        """When the last request ends."""
        return max(self.free.values())

    def replay(self, event: Event, compute: float) -> float:
        """One ``("io", kind, bytes, token)`` or ``("io_wait", token)`` at compute time ``compute``;
        the compute clock after it."""
        if event[0] == "io":
            _, kind, nbytes, token = event
            if self.rates[kind] <= 0:
                raise ValueError(
                    f"machine {self.machine.name!r} has no NVMe {kind} rate: give Machine(nvme_read=..., "
                    "nvme_write=...) in bytes/s, or calibrate(nvme_path=...) (--nvme-path) to measure a disk."
                )
            seconds = nbytes / self.rates[kind]
            self.busy += seconds
            self.free[kind] = max(self.free[kind], compute) + seconds
            self._ends[token] = self.free[kind]
            return compute
        end = self._ends.pop(event[1], 0.0)
        self.stalled += max(0.0, end - compute)
        return max(compute, end)


# -- this machine's disk ----------------------------------------------------------------------------


def measure_disk(path: str, seconds: float = 1.0, nbytes: int = 64 << 20) -> tuple[float, float]:
    """Bytes/s of writing and reading swap files under ``path`` with the disk tier's own store
    (:class:`~lightning_zero.offload.nvme.SwapStore`: direct I/O under the compiled engines), about
    ``seconds`` in all: a ``nbytes`` tensor written and read back, repeated while time remains."""
    config = NvmeConfig(path=tempfile.mkdtemp(prefix="lightning_zero_calibrate_", dir=path))
    store = SwapStore(config, rank=os.getpid())
    tensor = torch.ones(nbytes // 4)
    item = [("probe", tensor)]
    write = read = 0.0
    rounds = 0
    try:
        deadline = time.perf_counter() + seconds
        while rounds < 1 or time.perf_counter() < deadline:
            start = time.perf_counter()
            store.evict(item)
            store.release(item)
            middle = time.perf_counter()
            store.fetch(item)
            store.wait(item)
            write += middle - start
            read += time.perf_counter() - middle
            rounds += 1
    finally:
        store.close(bring_back=False)
        os.rmdir(config.path)
    return rounds * nbytes / read, rounds * nbytes / write
