"""The peak of a training step's transient memory, counted on meta tensors.

:class:`LiveBytes` watches every op of the step: a tensor whose storage is new (not a view or an
in-place result of an input) adds its storage's bytes, and the storage's end (a weak-reference
finalizer, run when autograd, the engine or the model drops the last reference) takes them away. So
saved activations live until the backward frees them, gradients until the engine has copied them into
its buckets, checkpointed modules' recomputed activations only within their backward; the largest sum
reached is the step's transient peak, over what was alive when it began (the model states and the
engine's pool, counted by ``memory_breakdown()``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created in the block and still alive: ``current`` and ``peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def alive(self) -> dict[int, int]:
        """The storages created in the block and alive now: ``{storage key: bytes}``."""
        return dict(self._live)

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue  # in place, or already counted
            self._live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key)
        return out
