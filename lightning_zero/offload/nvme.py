"""The disk tier of ZeRO-Infinity: optimizer states in files under ``nvme_path``, streamed through
host memory one flat buffer (sub-group) at a time during the step.

Each swapped tensor (a buffer's fp32 ``master``, ``exp_avg``, ``exp_avg_sq``; all ``(shard_numel,)``
fp32) keeps its shape at rest but its storage is resized to zero bytes, so it holds no memory;
its values are in one file (padded to ``block_size``). :meth:`SwapStore.fetch` resizes the storage
back and reads the file into it on the I/O threads; :meth:`SwapStore.evict` writes it behind and
frees the storage when the write is done. The tensor objects never change, so the optimizer's
``param_groups``, its ``state`` keys and ``master.grad`` stay valid throughout.

Files live in ``<nvme_path>/lightning_zero-rank<r>/``, with ``owner.json`` naming the pid and host
of the run, one file per swapped tensor (``opt<o>.<buffer>.<key>.swp`` for optimizer ``o``'s
states, ``param<i>.swp``, ``grad<i>.swp``). A second store of the same rank alive in this process
(two strategies or engines at once) takes ``lightning_zero-rank<r>.1``, ``.2``, ..., so no two
stores share a file. A directory left by a killed run (its pid no longer alive on this host) is
removed at the next start; one whose owner is another live process is an error. :meth:`SwapStore.close` removes the directory
(at the end of fit and from the strategy's failure path).

Checkpoints read swapped tensors through :meth:`SwapStore.mapped` (a private memory map of the
file: page cache, not anonymous memory), so a save streams them from disk.

I/O engines (``NvmeConfig.aio_engine``), each a call per tensor from this store's thread pools
(``threads`` workers for reads and as many for writes, so that many tensors move at once in each
direction and a queue of writes never holds up the next read), each releasing the GIL so the
step's compute overlaps the I/O:

* "io_uring": ``torch.ops.lightning_zero.swap_uring`` (csrc/cpu/swap_uring.cpp), the tensor split
  into ``block_size`` requests of which ``queue_depth`` are in flight at once, submitted and reaped
  by the calling thread through an io_uring (raw system calls, no liburing);
* "threads": ``torch.ops.lightning_zero.swap_io`` (csrc/cpu/swap_io.cpp), the same requests served
  by ``threads`` C++ threads with pread/pwrite;
* "python", the readable reference: the pool's threads issue ``os.preadv``/``os.pwrite`` of
  ``block_size`` chunks straight into the tensors' memory (ctypes views), through the page cache.

"auto" (the default) takes the first that works here: io_uring when the extension is built and
:func:`io_uring_probe` (a ring set up and one NOP completed) succeeds, else threads, else python.
Asking for an engine that is not available falls back down that list with a one-time
``RuntimeWarning`` (seccomp in containers often blocks io_uring; never an error).

The compiled engines open the files with O_DIRECT when ``direct_io`` (and the file system takes
it) and pad each file to whole blocks. O_DIRECT wants 4096-aligned addresses: :meth:`SwapStore.allocate`
gives every tensor the store brings back into memory 4096-aligned storage
(``torch.ops.lightning_zero.host_alloc_aligned``), so whole blocks go straight between the tensor
and the disk; the last, partial block of a tensor, and tensors torch allocated (64-byte aligned, e.g.
fresh optimizer states before their first write), go through aligned bounce blocks. That memory
comes from a pool (csrc/cpu/host_pool.cpp): a freed tensor's block is kept and handed to the next
tensor of about its size, so the steady state touches no fresh pages (first-touch faults and
unmapping cost more CPU than the I/O: ~0.4 s of system time per GB on a 2-core VM); the pool never
holds more than the most the store had in use at once, and :meth:`SwapStore.close` empties it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lightning_zero.config import AIO_ENGINES, NvmeConfig

MARKER = "owner.json"
_warned: set[str] = set()  # the fallbacks warned about (once per process each)


def _has_op(name: str) -> bool:
    from lightning_zero.ops import compiled

    return compiled() and hasattr(torch.ops.lightning_zero, name)


def compiled_engine() -> bool:
    """Whether the compiled thread-pool engine (``torch.ops.lightning_zero.swap_io``) is built."""
    return _has_op("swap_io")


@functools.cache
def io_uring_probe(queue_depth: int) -> str | None:
    """``None`` when an io_uring of ``queue_depth`` entries works in this process (set up, one NOP
    completed), else why not (an old kernel, ``kernel.io_uring_disabled``, a seccomp filter)."""
    if not compiled_engine() or not _has_op("swap_uring"):
        return "lightning_zero._C is not built with swap_uring"
    reason = torch.ops.lightning_zero.swap_uring_probe(queue_depth)
    return reason or None


def _fall_back(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def choose_engine(requested: str, queue_depth: int) -> str:
    """The engine that runs for ``aio_engine=requested``: "io_uring", "threads" or "python" (see the
    module docstring; a fallback from the engine asked for warns once)."""
    if requested not in AIO_ENGINES:
        raise ValueError(f"aio_engine={requested!r} must be one of {list(AIO_ENGINES)}.")
    if requested in ("auto", "io_uring"):
        reason = io_uring_probe(queue_depth)
        if reason is None:
            return "io_uring"
        if requested == "io_uring":
            _fall_back(
                "io_uring",
                f"lightning_zero.offload.nvme: aio_engine='io_uring' is not available here ({reason}); the disk "
                "tier uses the next engine (threads with pread/pwrite, or Python threads without the extension).",
            )
    if requested != "python" and compiled_engine():
        return "threads"
    if requested != "python":
        _fall_back(
            "python",
            "lightning_zero.offload.nvme: the compiled I/O engine is not available; the disk tier uses "
            "Python threads with os.pread/os.pwrite through the page cache (correct, without O_DIRECT). "
            "Rebuild the extension (pip install --no-build-isolation -e .) for the compiled engine.",
        )
    return "python"


def rank_directory(config: NvmeConfig, rank: int) -> Path:
    """Where global rank ``rank`` keeps its swap files."""
    return Path(config.path) / f"lightning_zero-rank{rank}"


def check_free_space(config: NvmeConfig, needed: int) -> None:
    """Raise ``ValueError`` unless the file system under ``config.path`` has ``needed`` bytes free.
    Call before anything is allocated or written."""
    probe = Path(config.path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the directory is created later; its file system is its nearest parent's
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise ValueError(
            f"nvme_path={config.path!r}: this run writes {needed} bytes ({needed / 2**30:.2f} GiB) of swap files "
            f"(optimizer states, and parameter shards under offload_parameters='nvme') but only {free} bytes ({free / 2**30:.2f} GiB) are free there; free space, choose another "
            "nvme_path, or use offload_optimizer=True (host memory)."
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


_live: set[Path] = set()  # directories claimed by this process's open stores


def claim_directory(directory: Path) -> Path:
    """Create ``directory`` with this process's marker, removing a stale one left by a killed run;
    when a store of this process holds it, the first free ``<directory>.<k>`` instead. Returns the
    directory claimed (:func:`release_directory` when done)."""
    k = 0
    while directory in _live:
        k += 1
        directory = directory.with_name(f"{directory.name.split('.')[0]}.{k}")
    marker = directory / MARKER
    if directory.exists():
        owner = {}
        with contextlib.suppress(OSError, ValueError):  # no or torn marker: killed while creating it
            owner = json.loads(marker.read_text())
        pid, host = owner.get("pid"), owner.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
            raise ValueError(
                f"{directory} is in use by process {pid} on {host} (another run with the same nvme_path and rank); "
                "give each run its own nvme_path."
            )
        warnings.warn(
            f"removing the stale swap directory {directory} of a run that ended without cleanup ({owner})", stacklevel=3
        )
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    marker.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    _live.add(directory)
    return directory


def release_directory(directory: Path) -> None:
    """Remove ``directory`` (claimed by :func:`claim_directory`) and its files."""
    shutil.rmtree(directory, ignore_errors=True)
    _live.discard(directory)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as a writable byte view. Through ctypes, not ``tensor.numpy()``: a numpy
    view marks the storage non-resizable, and the tier frees memory by resizing storages to 0.
    Valid while the storage keeps its current allocation (the store waits for I/O before resizing)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


Swapped = tuple[str, torch.Tensor]
"""A swapped tensor and the name of its file (e.g. ``"3.exp_avg"``); a new tensor under a known
name (after ``optimizer.load_state_dict``) takes over that file."""


class SwapStore:
    """The swap files of one rank; see the module docstring.

    Args:
        config: path and I/O knobs.
        rank: global rank (names the directory).
        engine: an ``aio_engine`` value overriding ``config.aio_engine`` (tests, benchmarks); the
            engine that runs is :attr:`engine` ("io_uring", "threads" or "python").
    """

    def __init__(self, config: NvmeConfig, rank: int, engine: str | None = None) -> None:
        self.config = config
        self.engine = choose_engine(config.aio_engine if engine is None else engine, config.queue_depth)
        self.directory = claim_directory(rank_directory(config, rank))
        # one pool per direction: the step reads the next sub-group while it writes the last one,
        # and this disk serves both at once (~2 GB/s each here); one shared FIFO let a batch of
        # writes take every worker while reads waited behind it, and the other direction idled
        self._pools = {
            write: ThreadPoolExecutor(config.threads, thread_name_prefix=f"lightning_zero_nvme_{'w' if write else 'r'}")
            for write in (False, True)
        }
        self._fds: dict[str, int] = {}
        self._tensors: dict[str, torch.Tensor] = {}  # the tensor each file belongs to now
        self._pending: dict[str, tuple[str, list[Future], int]] = {}  # name -> (read/write, requests, bytes)
        #: bytes moved so far, and seconds the caller waited on reads / writes (benchmarks read them)
        self.bytes_read = 0
        self.bytes_written = 0
        self.stall = {"read": 0.0, "write": 0.0}
        #: seconds during which at least one read (write) was running on a worker: bytes over these
        #: are the rates the I/O itself achieved (benchmarks/capacity.py), whatever the step did else
        self.busy = {"read": 0.0, "write": 0.0}
        self._running = {"read": [0, 0.0], "write": [0, 0.0]}  # per direction: requests running, since
        self._busy_lock = threading.Lock()

    @staticmethod
    def resident(tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s values are in memory (not swapped out)."""
        return tensor.untyped_storage().nbytes() > 0

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory, which this store can swap (the tiers ask before they
        take a tensor; the planner's store, :mod:`lightning_zero.plan.disk`, answers for meta tensors)."""
        return tensor.device.type == "cpu"

    def allocate(self, tensor: torch.Tensor) -> None:
        """Give a swapped-out ``tensor`` (storage of zero bytes) memory for its elements (values
        undefined): 4096-aligned under a compiled engine with ``direct_io``, so its whole blocks go
        to and from the disk without a bounce copy; torch's allocator otherwise."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.engine != "python" and self.config.direct_io and nbytes > 0 and _has_op("host_alloc_aligned"):
            torch.ops.lightning_zero.host_alloc_aligned(tensor)
        else:
            tensor.untyped_storage().resize_(nbytes)

    # -- chunked I/O on the pool --------------------------------------------------------------------

    def _submit(self, name: str, tensor: torch.Tensor, write: bool) -> None:
        if self.engine != "python":
            path, c = str(self.directory / f"{name}.swp"), self.config
            if self.engine == "io_uring":
                op, width = torch.ops.lightning_zero.swap_uring, c.queue_depth
            else:
                op, width = torch.ops.lightning_zero.swap_io, c.threads
            future = self._pools[write].submit(
                self._timed, write, op, tensor, path, write, c.block_size, width, c.direct_io
            )
            nbytes = tensor.numel() * tensor.element_size()
            self._pending[name] = ("write" if write else "read", [future], nbytes)
            self.bytes_written += nbytes if write else 0
            self.bytes_read += 0 if write else nbytes
            return
        fd, view, block = self._fds[name], _bytes_of(tensor), self.config.block_size
        chunks = [(view[offset : offset + block], offset) for offset in range(0, len(view), block)]
        if write:
            pool = self._pools[True]
            self._pending[name] = (
                "write",
                [pool.submit(self._timed, True, os.pwrite, fd, c, o) for c, o in chunks],
                len(view),
            )
            self.bytes_written += len(view)
        else:
            pool = self._pools[False]
            self._pending[name] = (
                "read",
                [pool.submit(self._timed, False, os.preadv, fd, [c], o) for c, o in chunks],
                len(view),
            )
            self.bytes_read += len(view)

    def _timed(self, write: bool, fn: Callable[..., int], *args: Any) -> int:
        """``fn(*args)`` on a worker, counted in :attr:`busy` (the union of the direction's running times)."""
        kind = "write" if write else "read"
        running = self._running[kind]
        with self._busy_lock:
            if running[0] == 0:
                running[1] = time.perf_counter()
            running[0] += 1
        try:
            return fn(*args)
        finally:
            with self._busy_lock:
                running[0] -= 1
                if running[0] == 0:
                    self.busy[kind] += time.perf_counter() - running[1]

    def done(self, name: str) -> bool:
        """Whether the I/O issued for ``name`` has completed (without waiting)."""
        pending = self._pending.get(name)
        return pending is None or all(future.done() for future in pending[1])

    def mapped(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A read-only view of a swapped-out ``tensor``'s values, memory-mapped from its file
        (``MAP_PRIVATE``: pages come from the page cache as they are read, and the kernel can drop
        them again, so reading every file costs no anonymous memory); ``None`` when ``tensor`` is
        not swapped out here. Valid until the file is next written (the next step)."""
        name = next((n for n, t in self._tensors.items() if t is tensor), None)
        if name is None or self.resident(tensor):
            return None
        self.wait([(name, tensor)])  # a write behind still in flight
        path = str(self.directory / f"{name}.swp")
        return torch.from_file(path, shared=False, size=tensor.numel(), dtype=tensor.dtype).view(tensor.shape)

    def rename(self, tensor: torch.Tensor, name: str) -> None:
        """The file of ``tensor`` (swapped out under another name, e.g. by the sharded build before its
        owner existed) is from now on ``name``'s. A no-op when ``tensor`` is not known here."""
        old = next((n for n, t in self._tensors.items() if t is tensor), None)
        if old is None or old == name:
            return
        assert name not in self._tensors, f"swap file {name} is taken"
        self.wait([(old, tensor)])
        self._move(old, name)
        if old in self._fds:
            self._fds[name] = self._fds.pop(old)
        self._tensors[name] = self._tensors.pop(old)

    def forget(self, names: Iterable[str]) -> None:
        """Stop tracking ``names`` (waiting for their I/O): :meth:`fetch_all` and :meth:`close` leave
        their tensors alone; their files are removed with the directory."""
        for name in names:
            if name in self._tensors:
                self.wait([(name, self._tensors.pop(name))])

    def wait(self, items: Iterable[Swapped]) -> None:
        """Block until the reads/writes issued for ``items`` are done (I/O errors raise here)."""
        for name, _ in items:
            if name not in self._pending:
                continue
            kind, futures, expected = self._pending.pop(name)
            start = time.perf_counter()
            done = sum(future.result() for future in futures)
            self.stall[kind] += time.perf_counter() - start
            if done != expected:
                raise OSError(f"short {kind} on the swap file {self.directory / name}: {done} of {expected} bytes")

    # -- tier moves ---------------------------------------------------------------------------------

    def evict(self, items: Iterable[Swapped]) -> None:
        """Start writing ``items`` to their files (created the first time). :meth:`release` frees
        their memory once written."""
        for name, tensor in items:
            if not self.is_host(tensor) or not tensor.is_contiguous():
                raise ValueError(f"swap tensor {name} must be contiguous host memory (got {tensor.device})")
            if name not in self._fds:
                self._fds[name] = self._create(name, tensor)
            self.wait([(name, tensor)])
            self._tensors[name] = tensor
            self._submit(name, tensor, write=True)

    # -- the file system (what the planner's store records instead: lightning_zero.plan.disk) ---------

    def _create(self, name: str, tensor: torch.Tensor) -> int:
        """Create ``name``'s file for ``tensor`` with its blocks reserved; its descriptor."""
        fd = os.open(self.directory / f"{name}.swp", os.O_RDWR | os.O_CREAT, 0o600)
        self._reserve(fd, tensor)
        return fd

    def _move(self, old: str, name: str) -> None:
        """Rename the file ``old`` to ``name``."""
        os.replace(self.directory / f"{old}.swp", self.directory / f"{name}.swp")

    def file_bytes(self, tensor: torch.Tensor) -> int:
        """Bytes of ``tensor``'s file: padded to whole ``block_size`` blocks under the compiled engines."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.engine != "python":
            nbytes = -(-nbytes // self.config.block_size) * self.config.block_size
        return nbytes

    def _reserve(self, fd: int, tensor: torch.Tensor) -> None:
        """Allocate a new file's blocks up front (its padded size under the compiled engines): its
        first write is then an overwrite of allocated (unwritten) extents, which ext4 and XFS take
        under a shared lock, so concurrent O_DIRECT requests into one file proceed in parallel and
        io_uring need not hand them to its worker threads; a full disk fails here (ENOSPC), before
        any request. File systems without fallocate (tmpfs before 3.5, some network ones) skip it."""
        nbytes = self.file_bytes(tensor)
        if nbytes > 0:
            with contextlib.suppress(AttributeError):  # (no posix_fallocate: not Linux)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as error:
                    if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise OSError(
                            error.errno, f"reserving {nbytes} bytes for a swap file: {error.strerror}"
                        ) from None

    def release(self, items: Iterable[Swapped]) -> None:
        """Wait for their writes, then shrink the storage of ``items`` to zero bytes."""
        items = list(items)
        self.wait(items)
        for _, tensor in items:
            tensor.untyped_storage().resize_(0)

    def fetch(self, items: Iterable[Swapped]) -> None:
        """Give swapped-out ``items`` their memory back and start reading their files into it;
        :meth:`wait` before use. Resident ones are left alone."""
        for name, tensor in items:
            self.wait([(name, tensor)])
            if self.resident(tensor):
                continue
            self.allocate(tensor)
            self._submit(name, tensor, write=False)

    def fetch_all(self) -> None:
        """Everything back into memory (blocking)."""
        items = list(self._tensors.items())
        self.fetch(items)
        self.wait(items)

    def close(self, bring_back: bool) -> None:
        """Remove the files and the directory; first read every tensor back into memory when
        ``bring_back`` (so the optimizer stays usable, e.g. for a checkpoint after fit)."""
        if bring_back:
            self.fetch_all()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pending.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._tensors.clear()
        if _has_op("host_pool_trim"):
            torch.ops.lightning_zero.host_pool_trim()  # the freed blocks back to the allocator
        release_directory(self.directory)
