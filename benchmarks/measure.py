"""What ``run.py`` measures, the same way for every system: step clocks, live tensor bytes, formulas.

* Step time: the interval between consecutive step ends on rank 0 (collectives keep the ranks in
  lockstep), warm-up steps dropped.
* Bytes per rank: every floating-point tensor alive in the process at the end of the last step
  (after the optimizer step, gradients still held), distinct storages counted once, minus what was
  alive before the run was built. That counts what each system really keeps between steps
  (parameters, gradients, fp32 masters, optimizer states, and any persistent communication
  buffers) without knowing its internals; DTensors (FSDP2) count their local shard.
* Peak RSS per rank: what the OS counts, ``VmHWM`` (the process's peak resident set) at the end of
  the last step minus ``VmRSS`` when the run began, in a process of its own per configuration
  (``run.py`` spawns fresh ranks for it: an allocator that ran other systems before holds their freed
  pages, which would flatter whoever runs later). Everything counts: parameters, gradients,
  optimizer states, communication buffers, activations, allocator slack, Lightning's own objects.
* Formulas: the ZeRO paper's model-state bytes per rank (arXiv 1910.02054 §5), for Ψ parameters
  on N ranks with Adam.
"""

from __future__ import annotations

import gc
import time
import warnings

import torch

from lightning_zero.memory import reset_peak_resident, resident_bytes, trim_heap

#: system -> ZeRO stage whose formula applies; the dtype it keeps parameters in decides mixed vs fp32
STAGE = {
    "ddp": 0,
    "zero_redundancy": 1,
    "fsdp2": 3,
    "fsdp2_no_reshard": 3,
    "zero1": 1,
    "zero2": 2,
    "zero3": 3,
    "zero2_offload": 2,
    "zero3_offload": 3,
    "ds0": 0,
    "ds1": 1,
    "ds2": 2,
    "ds3": 3,
    "ds2_offload": 2,
    "ds3_offload": 3,
}
#: systems that keep fp32 parameters and gradients under "bf16-mixed" (autocast), so their formula
#: is the fp32 one: Lightning's DDP, torch's ZeroRedundancyOptimizer, FSDP2 (fp32 shards)
FP32_STATES = {"ddp", "zero_redundancy", "fsdp2", "fsdp2_no_reshard"}


def formula_bytes(system: str, precision: str, psi: int, n: int) -> dict[str, float]:
    """``{"device": bytes, "host": bytes}`` of model states per rank for Adam.

    Mixed precision (16-bit parameters and gradients, fp32 master + 2 states): stage 0 16Ψ,
    1: 4Ψ + 12Ψ/N, 2: 2Ψ + 14Ψ/N, 3: 16Ψ/N. fp32 (parameters are the masters): 16Ψ, 8Ψ + 8Ψ/N,
    4Ψ + 12Ψ/N, 16Ψ/N. Offload moves the fp32 master and the states (12Ψ/N) to the host, and with
    stage 3's parameter offload the 16-bit parameter shard (2Ψ/N) too.
    """
    system = system.split("@")[0]  # a variant with options (systems.variant) has its system's formula
    stage = STAGE[system]
    mixed = precision != "32-true" and system not in FP32_STATES
    if mixed:
        total = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n][stage]
    else:
        total = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n][stage]
    host = 0.0
    if system.endswith("_offload"):
        host = 12 * psi / n + (2 * psi / n if stage == 3 else 0)
    return {"device": total - host, "host": host}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the bytes: a DTensor's local shard, otherwise the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def live_tensor_bytes() -> dict[int, int]:
    """``{storage data_ptr: nbytes}`` of every floating-point tensor reachable by the garbage collector."""
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        # isinstance() on some module proxies among the gc objects emits deprecation warnings
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            t = _local(obj)
            if not t.is_floating_point() or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError, NotImplementedError):
            continue  # tensors without a storage (wrapper subclasses, freed weakrefs)
    storages.pop(0, None)  # empty tensors and freed FSDP2 buffers have no data
    return storages


class Baseline:
    """Bytes alive now, to subtract from the end-of-run count (leftovers of earlier runs in this process)."""

    def __init__(self) -> None:
        # A total, not a set of addresses: a freed block's address is often reused for a new one.
        self.before = sum(live_tensor_bytes().values())

    def grown(self) -> int:
        """Bytes alive now minus bytes alive at construction."""
        return sum(live_tensor_bytes().values()) - self.before


class PeakRss:
    """Growth of this process's peak resident set from now on, as the OS counts it (Linux).

    At construction: garbage collected, the heap trimmed, the kernel's high-water mark reset
    (``/proc/self/clear_refs`` = 5) and the current RSS noted; :meth:`grown` is ``VmHWM`` minus it.
    """

    def __init__(self) -> None:
        gc.collect()
        trim_heap()
        # without the reset VmHWM may hold an earlier peak (then it is an upper bound)
        self.reset = reset_peak_resident()
        self.before = resident_bytes()["resident"]

    def grown(self) -> int:
        """Bytes: the peak resident set since construction minus the resident set at construction."""
        return resident_bytes()["peak_resident"] - self.before


class Clock:
    """Wall-clock stamps at step ends; ``listeners`` are called with the number of stamps so far
    (``run.py --profile`` starts and stops torch.profiler from there, around the timed steps only)."""

    listeners: list = []

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def tick(self) -> None:
        self.stamps.append(time.perf_counter())
        for listener in Clock.listeners:
            listener(len(self.stamps))

    def steps(self, warmup: int) -> list[float]:
        """Step durations after ``warmup`` steps (the first stamp only opens the first interval)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)][max(warmup - 1, 0) :]
