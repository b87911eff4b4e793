"""Per-rank memory accounting from live tensors (what ``ZeroStrategy.memory_breakdown()`` returns).

Bytes are counted per distinct storage, so a parameter that is a view into a flat buffer is not
counted twice. "device" is the training device; "host" is CPU memory when the training device is
not the CPU (on a CPU-only run everything is "device").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_zero.zero.engine import ZeroEngine

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


def memory_breakdown(module: nn.Module, engine: ZeroEngine | None, device: torch.device) -> dict[str, dict[str, int]]:
    """``{"device": {category: bytes}, "host": {category: bytes}}`` for this rank.

    Categories: parameters, gradients, master_weights, optimizer_states, buffers, communication_buckets
    (gradient buckets of stages 2/3, in use or pooled for reuse, at most two of the largest kept
    between steps; stage 1's persistent buckets are its gradients).
    """
    counter = _Counter(device)
    if engine is not None:
        for category, tensors in engine.memory_tensors().items():
            counter.add(category, tensors)
    counter.add("parameters", (p.data for p in module.parameters()))
    counter.add("gradients", (p.grad for p in module.parameters()))
    counter.add("buffers", module.buffers())
    return counter.bytes
