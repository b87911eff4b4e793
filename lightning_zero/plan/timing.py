"""Predicted step time: the plan's training step replayed on a :class:`~.machine.Machine`.

While the planner runs a step of the real engine on meta tensors it records, in the order they
happen, every op (its FLOPs from torch's own formulas, ``torch.utils.flop_counter``, and the bytes it
reads and writes), every collective the engine issues (synchronous or not) and every wait on an
asynchronous one (:class:`OpRecorder` and :func:`~.world.record_collectives`). :func:`step_time`
replays that order on two clocks, the rank's compute and its network: an op costs
``max(FLOPs / FLOP/s, bytes / bandwidth)`` (at least the per-op overhead), a collective starts when
it is issued and the network is free, and the compute waits only where the engine waits. So the
overlap is the engine's own: stage 3's prefetched all-gathers run under the modules before the one
that waits for them, gradient buckets reduce under the rest of the backward, and the engine's
blocking calls (the stage-3 gather-order check on gloo, the offloaded step's transfers) block.

Ops that touch host memory of an accelerator's rank (the offloaded optimizer step) run at the host's
bandwidth, and copies between host and device at the host link's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from lightning_zero.plan.disk import DiskClock
from lightning_zero.plan.machine import Machine

# ops that allocate without writing, or only relabel a storage: no bytes move
_FREE = {"detach", "alias", "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}
_FREE |= {"new_empty_strided", "set_", "resize_", "_has_compatible_shallow_copy_type"}
# the process group's own ops: their cost is the collective's, from the recorder
_COMMUNICATION = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}

Event = tuple[Any, ...]
"""``("op", where, dtype, flops, bytes)``, ``("issue", call, synchronous)``, ``("wait", call)``,
``("phase", name)``; ``call`` indexes the plan's list of the step's collectives; the NVMe tiers'
``("io", "read"|"write", bytes, token)`` and ``("io_wait", token)`` (:mod:`.disk`)."""


class OpRecorder(TorchDispatchMode):
    """Append one ``("op", where, dtype, flops, bytes)`` event per op dispatched in the block.

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
        flops = 0
        if func._overloadpacket in flop_registry:
            flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else ""
        self.events.append(("op", self._where(tensors + outputs), dtype, flops, nbytes))
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


def _op_seconds(event: Event, machine: Machine) -> float:
    _, where, dtype, flops, nbytes = event
    if where == "link":
        bandwidth = machine.host_link
    elif where == "host":
        bandwidth = machine.host_bandwidth or machine.memory_bandwidth
    else:
        bandwidth = machine.bandwidth(dtype, nbytes)
    compute = flops / machine.matmul_rate(dtype) if flops else 0.0
    return max(machine.op_overhead, compute, nbytes / bandwidth)


def step_time(events: Sequence[Event], calls: Sequence[tuple[str, int]], world_size: int, machine: Machine) -> StepTime:
    """Replay ``events`` (one step, as :class:`OpRecorder` and the collective recorder wrote them;
    ``calls``: each collective's ``(op, whole-buffer bytes)``) on ``machine``'s rates.

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
            seconds = _op_seconds(event, machine)
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
