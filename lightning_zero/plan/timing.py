"""Predicted step time: the plan's training step replayed on a :class:`~.machine.Machine`.

While the planner runs a step of the real engine on meta tensors it records, in the order they
happen, every op (its name, its FLOPs from torch's own formulas, ``torch.utils.flop_counter``, the
bytes it reads and writes, the storages it allocates), every collective the engine issues
(synchronous or not) and every wait on an asynchronous one (:class:`OpRecorder` and
:func:`~.world.record_collectives`). :func:`step_time` replays that order on two clocks, the rank's
compute and its network: an op costs what its class costs on the machine (:func:`op_seconds`: FLOPs,
bytes by size and kind, a rate measured for that op, fresh pages, the per-op cost), a collective starts when
it is issued and the network is free, and the compute waits only where the engine waits. So the
overlap is the engine's own: stage 3's prefetched all-gathers run under the modules before the one
that waits for them, gradient buckets reduce under the rest of the backward, and the engine's
blocking calls (the stage-3 gather-order check on gloo, the offloaded step's transfers) block.

Ops that touch host memory of an accelerator's rank (the offloaded optimizer step) run at the host's
bandwidth, and copies between host and device at the host link's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_zero.plan.disk import DiskClock
from lightning_zero.plan.machine import Machine, interpolate
from lightning_zero.plan.opclass import op_elements, op_flops, op_name

# ops that allocate without writing, or only relabel a storage: no bytes move
_FREE = {"detach", "alias", "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}
_FREE |= {"new_empty_strided", "set_", "resize_", "_has_compatible_shallow_copy_type"}
# the process group's own ops: their cost is the collective's, from the recorder
_COMMUNICATION = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}

Event = tuple[Any, ...]
"""``("op", where, dtype, flops, bytes, name, new, elements)``, ``("issue", call, synchronous)``,
``("wait", call)``, ``("phase", name)``; ``call`` indexes the plan's list of the step's collectives;
the NVMe tiers' ``("io", "read"|"write", bytes, token)`` and ``("io_wait", token)`` (:mod:`.disk`).
An op's ``name`` is the aten op's (:func:`~.opclass.op_name`), ``new`` the bytes of each storage it
allocates (none: it writes in place), ``elements`` the numel of its largest tensor; an op
event may stop after ``bytes`` (a synthetic one)."""


class OpRecorder(TorchDispatchMode):
    """Append one ``("op", where, dtype, flops, bytes, name, new, elements)`` event per op
    dispatched in the block.

    ``where``: ``"host"`` when every tensor of the op is in host memory (storages in ``host``),
    ``"link"`` for a copy between host and device, else ``"device"``; ``host`` is None on a CPU
    rank, whose memory is all "device"."""

    def __init__(self, events: list[Event], host: set[int] | None) -> None:
        super().__init__()
        self.events = events
        self.host = host

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _COMMUNICATION:
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        free = func.is_view or func._opname in _FREE
        nbytes = 0 if free else sum(t.numel() * t.element_size() for t in tensors + outputs)
        flops = op_flops(func, args, kwargs, out)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
        inputs = {t.untyped_storage()._cdata for t in tensors}
        new = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in outputs}
        fresh = tuple(n for key, n in new.items() if key not in inputs)
        name, elements = op_name(func, kwargs), op_elements(tensors, outputs)
        self.events.append(("op", self._where(tensors + outputs), dtype, flops, nbytes, name, fresh, elements))
        return out

    def _where(self, tensors: list[torch.Tensor]) -> str:
        if self.host is None or not tensors:
            return "device"
        on_host = [t.untyped_storage()._cdata in self.host for t in tensors]
        return "host" if all(on_host) else "link" if any(on_host) else "device"


@dataclass(frozen=True)
class StepTime:
    """One training step of one rank, predicted; seconds."""

    seconds: float
    """The step: compute, plus the communication the engine does not hide under it."""
    forward: float
    backward: float
    """Backward compute, with the reduction hooks' copies."""
    optimizer: float
    """The sharded step and the publish (compute only), on the device or the host."""
    host: float
    """Of the compute above, what runs in host memory or over the host link (offload)."""
    communication: float
    """Every collective of the step, end to end, as if nothing ran beside it."""
    exposed_communication: float
    """Of ``communication``, what the step waits for."""
    machine: str
    disk: float = 0.0
    """The NVMe tiers' reads and writes of the step at the machine's rates, as if nothing ran beside them."""
    exposed_disk: float = 0.0
    """Of ``disk``, what the step waits for (the rest runs under compute: read-ahead, write-behind)."""

    @property
    def overlapped(self) -> float:
        """Communication hidden under compute: ``communication - exposed_communication``."""
        return self.communication - self.exposed_communication


def fresh_threshold(device: str, mmap_threshold: int | None) -> float:
    """Bytes from which a new host tensor lands on fresh pages every time: the C library's mmap
    threshold (``MALLOC_MMAP_THRESHOLD_`` when set, else the strategy's ``host_mmap_threshold``,
    else glibc's dynamic threshold, which rises to at most 32 MiB); infinite on an accelerator,
    whose caching allocator keeps its memory."""
    if device != "cpu":
        return math.inf
    if os.environ.get("MALLOC_MMAP_THRESHOLD_", "").isdigit():
        return float(os.environ["MALLOC_MMAP_THRESHOLD_"])
    return float(mmap_threshold) if mmap_threshold is not None else float(32 << 20)


def op_seconds(event: Event, machine: Machine, fresh_above: float = math.inf) -> float:
    """Seconds of one ``("op", ...)`` event on ``machine``: a matrix product (an op with FLOPs) at the
    dtype's FLOP/s plus the machine's fixed cost of one; an element-wise op at the bandwidth of its
    size and kind (in place or not); an op the machine measured on its own (``op_elements``,
    ``op_flops``: activations, normalization, attention) at least at that rate; new outputs of at
    least ``fresh_above`` bytes at ``fresh_bandwidth`` besides; plus the per-op cost (added on a CPU
    rank, the larger on an accelerator)."""
    _, where, dtype, flops, nbytes = event[:5]
    name, new, elements = (*event[5:8], "", (), 0)[:3]  # a synthetic event may stop at bytes
    if where == "link":
        bandwidth = machine.host_link
    elif where == "host":
        bandwidth = machine.host_bandwidth or machine.memory_bandwidth
    else:
        bandwidth = machine.bandwidth(dtype, nbytes, in_place=not new)
    work = nbytes / bandwidth
    key = f"{name} {dtype}"
    if key in machine.op_flops:
        work = max(work, flops / interpolate(machine.op_flops[key], flops / max(elements, 1)))
    elif flops:
        work = max(work, machine.matmul_latency + flops / machine.matmul_rate(dtype))
    if key in machine.op_elements:
        work = max(work, elements / machine.op_elements[key])
    if where == "device":
        work += sum(n for n in new if n >= fresh_above) / machine.fresh_bandwidth
    return machine.op_overhead + work if machine.serial_overhead else max(machine.op_overhead, work)


def step_time(
    events: Sequence[Event],
    calls: Sequence[tuple[str, int]],
    world_size: int,
    machine: Machine,
    fresh_above: float = math.inf,
) -> StepTime:
    """Replay ``events`` (one step, as :class:`OpRecorder` and the collective recorder wrote them;
    ``calls``: each collective's ``(op, whole-buffer bytes)``) on ``machine``'s rates; new outputs of
    at least ``fresh_above`` bytes land on fresh pages (:func:`fresh_threshold`).

    Two clocks: the compute runs the ops in order; the network runs one collective at a time, each
    from when it is issued (and the previous one is done). A synchronous collective and a wait
    hold the compute until the collective ends. Of the communication that ran beside compute, the
    fraction ``1 - machine.overlap`` is added back (CPU ranks, whose collectives need the cores)."""
    compute = network = 0.0
    ends: dict[int, float] = {}
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    phase, host, communication = "forward", 0.0, 0.0
    disk = DiskClock(machine)
    for event in events:
        kind = event[0]
        if kind == "op":
            seconds = op_seconds(event, machine, fresh_above)
            compute += seconds
            phases[phase] += seconds
            host += seconds if event[1] != "device" else 0.0
        elif kind == "issue":
            op, nbytes = calls[event[1]]
            seconds = machine.link(op).seconds(op, nbytes, world_size)
            communication += seconds
            network = max(network, compute) + seconds
            ends[event[1]] = network
            if event[2]:
                compute = network
        elif kind == "wait":
            compute = max(compute, ends.get(event[1], 0.0))
        elif kind == "phase":
            phase = event[1]
        elif kind in ("io", "io_wait"):
            compute = disk.replay(event, compute)
    busy = sum(phases.values())
    end = max(compute, network, disk.end)
    exposed = min(communication, max(0.0, end - busy))
    seconds = end + (1 - machine.overlap) * (communication - exposed)
    return StepTime(
        seconds=seconds,
        forward=phases["forward"],
        backward=phases["backward"],
        optimizer=phases["optimizer"],
        host=host,
        communication=communication,
        exposed_communication=exposed,
        machine=machine.name,
        disk=disk.busy,
        exposed_disk=disk.stalled,
    )
