"""Per-rank memory accounting from live tensors (what ``ZeroStrategy.memory_breakdown()`` returns),
and the host allocator setting that makes the OS see what is alive.

Bytes are counted per distinct storage, so a parameter that is a view into a flat buffer is not
counted twice. "device" is the training device; "host" is CPU memory when the training device is
not the CPU (on a CPU-only run everything is "device").

What the OS counts (the resident set) is more than the live tensors: glibc serves large blocks
from ``mmap`` only until the first one is freed, then raises its threshold to that block's size
(up to 32 MiB) and serves blocks of that size from the heap, whose freed pieces stay resident and
fragment. A training step frees and allocates many such blocks (autograd's gradients, activations),
so the resident set ends far above the live bytes: measured at 2 CPU ranks, 8 square 2048 layers,
fp32, stage 3: peak RSS growth 503 MiB with glibc's default against 378 MiB with a fixed 1 MiB
threshold. :func:`fix_mmap_threshold` sets that threshold (``ZeroConfig.host_mmap_threshold``, at
setup; put back to glibc's default at teardown).

What else the OS counts at the peak of a step, and how to see it: :class:`MemoryMonitor` (a Lightning
callback) adds the activations (:class:`ActivationMeter`: the bytes autograd saved for backward, at
the end of forward) and the process's resident set (``VmRSS``, peak ``VmHWM``) to the breakdown.
Measured on the benchmark GPT (13.8M parameters, 2 CPU ranks, fp32, zero2 / zero3): model states
plus pool plus activations came to 0.74 / 0.72 of the peak RSS growth. Most of the rest is freed
memory that glibc keeps: allocations below ``host_mmap_threshold`` (most of that GPT's activations,
768 KiB each) come from its heaps, which stay resident after the free (at a steady-state step's
start the process held 125 MiB beyond its live tensors with a 1 MiB threshold, 58 MiB with 128 KiB);
then the process group's and Trainer's own memory (~20 MiB) and the batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_zero.zero import ZeroEngine

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states", "buffers", "communication_buckets")


class _Counter:
    def __init__(self, device: torch.device, place: Callable[[torch.Tensor], str] | None = None) -> None:
        self.device = device
        self.place = place
        self.seen: set[tuple[str, int]] = set()
        self.bytes = {where: dict.fromkeys(CATEGORIES, 0) for where in ("device", "host")}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None or not torch.is_tensor(tensor):
                continue
            meta = tensor.device.type == "meta"
            if meta and self.place is None:
                continue
            storage = tensor.untyped_storage()
            # Meta storages all have data_ptr 0: told apart by the storage object itself.
            key = (str(tensor.device), storage._cdata if meta else storage.data_ptr())
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            if self.place is not None:
                where = self.place(tensor)
            else:
                where = "device" if tensor.device.type == self.device.type else "host"
            self.bytes[where][category] += storage.nbytes()


def memory_breakdown(
    module: nn.Module,
    engine: ZeroEngine | None,
    device: torch.device,
    place: Callable[[torch.Tensor], str] | None = None,
) -> dict[str, dict[str, int]]:
    """``{"device": {category: bytes}, "host": {category: bytes}}`` for this rank.

    ``place`` (a tensor -> ``"device"`` or ``"host"``) counts meta tensors as well, by their
    storages' sizes, where it says: the planner (:mod:`lightning_zero.plan`) runs the engine on the
    meta device and counts its tensors with this very function.

    Categories: parameters, gradients, master_weights, optimizer_states, buffers, communication_buckets
    (gradient buckets of stages 2/3 in use, and the free blocks of the engine's pool: buckets and
    stage 3's gathered parameters, as many as one step used at once; stage 1's persistent buckets
    are its gradients).
    """
    counter = _Counter(device, place)
    if engine is not None:
        for category, tensors in engine.memory_tensors().items():
            counter.add(category, tensors)
    counter.add("parameters", (p.data for p in module.parameters()))
    counter.add("gradients", (p.grad for p in module.parameters()))
    counter.add("buffers", module.buffers())
    return counter.bytes


def _storage_key(storage: torch.UntypedStorage, meta: bool) -> int:
    # Meta storages all have data_ptr 0: told apart by the storage object itself.
    return int(storage._cdata) if meta else int(storage.data_ptr())


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward between :meth:`start` and :meth:`stop` (one
    forward): distinct storages, parameters and their flat buffers excluded (they are model states).

    Uses ``torch.autograd.graph.saved_tensors_hooks``: a user's own hooks inside (activation
    offload, non-reentrant checkpointing) take precedence, and what they keep is not counted. Costs
    one Python call per saved tensor; the storages are referenced only until :meth:`stop`.
    """

    def __init__(self, include_meta: bool = False) -> None:
        #: count meta tensors too, by their storages' sizes (the planner's forward on the meta device)
        self.include_meta = include_meta
        self.last = 0  # bytes at the end of the last metered forward
        self.peak = 0  # the most over all metered forwards
        self._saved: dict[int, torch.UntypedStorage] = {}
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) and (self.include_meta or tensor.device.type != "meta"):
            storage = tensor.untyped_storage()
            self._saved.setdefault(_storage_key(storage, tensor.device.type == "meta"), storage)
        return tensor

    def start(self) -> None:
        """Meter the saved tensors from now on (before forward)."""
        self.stop()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def stop(self, module: nn.Module | None = None) -> int:
        """Stop metering (before backward) and return the bytes saved, without the storages of
        ``module``'s parameters (stage 3's released ones hold 0 bytes by then)."""
        if self._hooks is None:
            return 0
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        if module is not None:
            for param in module.parameters():
                storage = param.untyped_storage()
                self._saved.pop(_storage_key(storage, param.device.type == "meta"), None)
        self.last = sum(storage.nbytes() for storage in self._saved.values())
        self.peak = max(self.peak, self.last)
        self._saved = {}
        return self.last


def resident_bytes() -> dict[str, int]:
    """This process's resident set as the OS counts it (Linux ``/proc/self/status``): ``resident``
    (VmRSS), ``peak_resident`` (VmHWM) and ``mapped_files`` (RssFile: pages of mapped files, mostly
    the code of the libraries, which grows as new kernels run for the first time); empty where that
    file does not exist."""
    try:
        with open("/proc/self/status") as f:
            status = f.read()
    except OSError:
        return {}
    out = {}
    for key, field in (("resident", "VmRSS"), ("peak_resident", "VmHWM"), ("mapped_files", "RssFile")):
        match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
        if match:
            out[key] = int(match.group(1)) * 1024
    return out


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): byte counts over all of malloc's arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc, else ``None`` (musl, macOS, Windows). Looked up
    once: ``find_library`` costs ~2 ms, and :class:`MemoryMonitor` asks after every forward."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "gnu_get_libc_version"):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _Mallinfo2
    return libc


def heap_free_bytes() -> int | None:
    """Bytes that glibc's malloc holds free in its heaps (``mallinfo2().fordblks``): memory the
    program freed but the process keeps, resident once touched (allocator slack). ``None`` on
    another C library or a glibc older than 2.33."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


#: glibc's ``mallopt`` parameter number and default value of ``M_MMAP_THRESHOLD``
_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD = -3, 128 * 1024


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or ``None`` on another C library (musl, macOS, Windows)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return None
    mallopt: Callable[[int, int], int] = libc.mallopt
    return mallopt


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve every host allocation of at least ``nbytes`` from ``mmap`` and return it to the OS when
    freed (glibc ``M_MMAP_THRESHOLD``; this also turns off glibc's dynamic raising of it). Returns
    whether it was set: not on another C library, nor when the user set ``MALLOC_MMAP_THRESHOLD_``
    in the environment (theirs wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _mallopt()
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def trim_heap() -> bool:
    """Give glibc's free heap memory back to the OS (``malloc_trim(0)``: whole free pages anywhere
    in its heaps, not only at their top). The engine calls it once, after setup has copied the
    model's parameters into its flat buffers: a model built before ``fit`` after something freed a
    large block (glibc then raises its threshold and serves later blocks from the heap) leaves its
    original parameters as holes in the heap, resident until trimmed (measured 109 MiB per rank on
    the 33.6M-parameter square benchmark model at stage 2, a third of its ZeRO formula). Not on the
    hot path. Returns whether it ran (glibc only)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def restore_mmap_threshold() -> None:
    """Put glibc's threshold back to its default (128 KiB). Its dynamic raising stays off: glibc
    offers no call that turns it on again."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    seen.pop(0, None)
    return sum(seen.values())


def reset_peak_resident() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux ``clear_refs`` = 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryMonitor(pl.Callback):
    """A Lightning callback: this rank's memory during training as the OS counts it, next to what it
    is made of. Add it to the Trainer's callbacks (``Trainer(callbacks=[MemoryMonitor()])``).

    At setup (before the strategy builds its engine) it notes the resident set and resets the peak
    mark; it meters the activations of every training step (:class:`ActivationMeter`) and samples
    the OS's view at the end of each forward, where the activations are all alive; at the end of
    every ``every_n_steps``-th batch it records in :attr:`last` (bytes)::

        model_states   memory_breakdown() without the pool (parameters, gradients, masters, states, buffers)
        pool           the engine's reusable blocks: gradient buckets and stage 3's gathered parameters
        activations    saved for backward at the end of this step's forward
        allocator      freed memory glibc's malloc kept in its heaps at the end of the forward,
                       beyond what it kept when training started (heap_free_bytes(); 0 where
                       unknown; an estimate: glibc does not say which free pages are resident)
        mapped_files   pages of mapped files (library code) that became resident since setup
        accounted      the five above
        resident       resident set at the end of the forward, minus the resident set at setup
                       without the model's parameters that already existed then (they are in
                       model_states): what ``accounted`` is compared with, at the same moment
        peak_growth    peak resident set since setup, on the same base
        other          peak_growth - accounted: what the backward adds on top of the forward's end
                       (the loss's gradient beside the activations), communication library
                       buffers, the batch, framework objects

    and logs them in MiB as ``memory/<key>`` when ``log=True``. ``reset_peak=False`` keeps the
    kernel's peak mark at setup (when something else measures the peak from an earlier point; then
    ``peak_growth`` may include a peak from before setup). Under other strategies (DDP) the
    breakdown counts the module's parameters and gradients only. Measured on the benchmark models
    (docs/stages.md, "Memory as the OS counts it"): ``accounted`` is within 10% of ``resident``.
    """

    def __init__(self, every_n_steps: int = 1, log: bool = False, reset_peak: bool = True) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an integer >= 1.")
        self.every_n_steps = every_n_steps
        self.log = log
        self.reset_peak = reset_peak
        self.meter = ActivationMeter()
        self.last: dict[str, int] = {}
        self._base = 0
        self._base_files = 0
        self._base_free = 0
        self._at_forward_end: dict[str, int] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.reset_peak:
            reset_peak_resident()
        os_view = resident_bytes()
        self._base = os_view.get("resident", 0) - _storage_bytes(
            list(pl_module.parameters()) + list(pl_module.buffers())
        )
        self._base_files = os_view.get("mapped_files", 0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the strategy's setup, which may have trimmed the heap (trim_heap): the free memory
        # glibc reports then is mostly not resident, and only what it frees from now on is counted.
        self._base_free = heap_free_bytes() or 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.meter.start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.meter.stop(pl_module)
        os_view = resident_bytes()
        self._at_forward_end = {
            "resident": os_view.get("resident", 0) - self._base,
            "mapped_files": os_view.get("mapped_files", 0) - self._base_files,
            "allocator": max(0, (heap_free_bytes() or 0) - self._base_free),
        }

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.stop(pl_module)  # no backward ran (e.g. a skipped batch)
        if (batch_idx + 1) % self.every_n_steps:
            return
        os_view = resident_bytes()  # before anything below allocates
        strategy = trainer.strategy
        if hasattr(strategy, "memory_breakdown"):
            split = strategy.memory_breakdown()
        else:
            split = memory_breakdown(pl_module, None, strategy.root_device)
        pool = sum(where["communication_buckets"] for where in split.values())
        states = sum(sum(where.values()) for where in split.values()) - pool
        forward_end = self._at_forward_end
        allocator, files = forward_end.get("allocator", 0), max(0, forward_end.get("mapped_files", 0))
        accounted = states + pool + self.meter.last + allocator + files
        peak_growth = os_view.get("peak_resident", 0) - self._base
        self.last = {
            "model_states": states,
            "pool": pool,
            "activations": self.meter.last,
            "allocator": allocator,
            "mapped_files": files,
            "accounted": accounted,
            "resident": forward_end.get("resident", 0),
            "peak_growth": peak_growth,
            "other": peak_growth - accounted,
        }
        if self.log:
            pl_module.log_dict({f"memory/{k}": v / 2**20 for k, v in self.last.items()}, on_step=True, on_epoch=False)
