"""Per-rank memory accounting from live tensors (what ``ZeroStrategy.memory_breakdown()`` returns).

Bytes are counted per distinct storage, so a parameter that is a view into a flat buffer is not
counted twice. "device" is the training device; "host" is CPU memory when the training device is
not the CPU (on a CPU-only run everything is "device").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states", "buffers", "communication_buckets")


class _Counter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen: set[tuple[str, int]] = set()
        self.bytes = {where: dict.fromkeys(CATEGORIES, 0) for where in ("device", "host")}

    def add(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            if tensor is None or not torch.is_tensor(tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            where = "device" if tensor.device.type == self.device.type else "host"
            self.bytes[where][category] += storage.nbytes()


def memory_breakdown(module: nn.Module, engine, device: torch.device) -> dict[str, dict[str, int]]:
    """``{"device": {category: bytes}, "host": {category: bytes}}`` for this rank.

    Categories: parameters, gradients, master_weights, optimizer_states, buffers, communication_buckets
    (gradient buckets of stages 2/3, in use or pooled for reuse, at most two of the largest kept
    between steps; stage 1's persistent buckets are its gradients).
    """
    counter = _Counter(device)
    if engine is not None:
        every = engine.buffers + engine.frozen
        counter.add("parameters", (b.flat_param if b.persistent else b.param_shard for b in every))
        counter.add("master_weights", (b.master for b in engine.buffers if b.separate_master))
        persistent = engine.config.stage == 1
        counter.add("gradients", (b.grad_bucket for b in engine.buffers if persistent))
        counter.add("gradients", (b.grad_shard for b in engine.buffers))
        counter.add("communication_buckets", (b.grad_bucket for b in engine.buffers if not persistent))
        # freed buckets kept for reuse (a fresh multi-MB CPU allocation page-faults: see reduce.py)
        counter.add("communication_buckets", engine.reducer.pool.free)
        for sharded in engine.sharded.values():
            for state in sharded.optimizer.state.values():
                counter.add("optimizer_states", state.values())
    counter.add("parameters", (p.data for p in module.parameters()))
    counter.add("gradients", (p.grad for p in module.parameters()))
    counter.add("buffers", module.buffers())
    return counter.bytes
