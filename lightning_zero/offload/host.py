"""Host memory for ZeRO-Offload: page-locked when a GPU is involved, plain otherwise.

Page-locked (pinned) host memory is what lets device-to-host and host-to-device copies run
asynchronously (``non_blocking=True``) at full bus speed. On a CPU-only machine the "device" is the
host: these helpers then return ordinary CPU tensors and the copies are plain memory copies.
"""

from __future__ import annotations

import torch


def _pin(wanted: bool) -> bool:
    return wanted and torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """An uninitialized 1-D host tensor (pinned when ``pin`` and a GPU exists)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=_pin(pin))


def host_copy(tensor: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned when ``pin`` and a GPU exists); blocks until complete."""
    out = host_empty(tensor.numel(), tensor.dtype, pin).view(tensor.shape)
    out.copy_(tensor)
    return out
