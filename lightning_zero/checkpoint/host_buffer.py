"""The host memory an asynchronous save copies this rank's shards into.

The copy is the only part of an async save the training loop waits for (:mod:`~lightning_zero.checkpoint.save`:
the writer thread pickles, checksums, writes and fsyncs from it). It is fast only into memory that
is already mapped: on the 2-core test machine a copy into fresh pages runs at ~1.6 GB/s (the kernel
faults and zeroes every 4 KiB page), into touched pages at ~7 GB/s. So one :class:`HostBuffer` per
run is kept and reused by every save, and :meth:`HostBuffer.reserve` allocates and touches it from a
background thread after the first optimizer step, before the first save needs it.

Layout: one flat tensor per dtype (``torch.save`` refuses one storage seen as two dtypes). Of every
storage the payload's tensors view, the range they cover is copied into its own 64-byte aligned
slot (a piece of a flat buffer on the GPU: that piece, not the buffer); the tensors handed to the
writer are views of the used part of the flat tensor, whose storage is exactly that part, so the
file holds the same values as a synchronous save's, in one record per dtype.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_zero.zero import exact_storage


class _Reader(Protocol):
    def wait(self) -> None: ...


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class HostBuffer:
    """Host memory for an asynchronous save's copy of this rank's shards, kept and reused by every
    save of a run (one per strategy; see the module docstring). Grown only when a payload needs
    more than it holds; not zero-filled by a copy (every slot is written, the gaps between slots
    are zeroed). A copy waits for the previous save's writer, which reads the buffer, and for
    :meth:`reserve`'s thread."""

    ALIGN = 64

    def __init__(self) -> None:
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self.user: _Reader | None = None
        """The save whose writer reads the buffer now."""
        self._reserving: threading.Thread | None = None
        self.reserved = False
        """Whether :meth:`reserve` was called (the strategy calls it once per fit)."""

    @property
    def nbytes(self) -> int:
        self._join()
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    @staticmethod
    def _extent(tensor: torch.Tensor) -> tuple[int, int]:
        """``[first, end)`` element of its storage that ``tensor`` views."""
        first = int(tensor.storage_offset())
        if tensor.numel() == 0:
            return first, first
        return first, first + 1 + sum(
            (int(n) - 1) * step for n, step in zip(tensor.shape, tensor.stride(), strict=True)
        )

    def _plan(self, payload: Any) -> tuple[dict[tuple[int, int], list[Any]], dict[torch.dtype, int]]:
        """Per storage viewed by ``payload``'s tensors ``[storage, dtype, first, end, slot byte offset]``,
        and the bytes needed per dtype."""
        covered: dict[tuple[int, int], list[Any]] = {}
        for tensor in (t for t in tree_leaves(payload) if isinstance(t, torch.Tensor)):
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            first, end = self._extent(tensor)
            if key not in covered:
                covered[key] = [storage, tensor.dtype, first, end, 0]
            else:
                covered[key][2] = min(covered[key][2], first)
                covered[key][3] = max(covered[key][3], end)
        sizes: dict[torch.dtype, int] = {}
        for entry in covered.values():
            _, dtype, first, end, _ = entry
            entry[4] = sizes.get(dtype, 0)
            sizes[dtype] = entry[4] + -(-(end - first) * _itemsize(dtype) // self.ALIGN) * self.ALIGN
        return covered, sizes

    def reserve(self, payload: Any) -> None:
        """Allocate and touch, in a background thread, the memory :meth:`copy` will need for a payload
        like ``payload`` (tensors of the same sizes; their values are not read), so that the first
        async save copies into mapped pages. Call between steps; :meth:`copy` waits for the thread."""
        self._join()
        self.reserved = True
        _, sizes = self._plan(payload)
        wanted = {
            d: n // _itemsize(d)
            for d, n in sizes.items()
            if d not in self._flat or self._flat[d].numel() < n // _itemsize(d)
        }
        if not wanted:
            return

        def touch() -> None:
            for dtype, numel in wanted.items():
                self._flat[dtype] = torch.zeros(numel, dtype=dtype)  # zero-filling faults every page in

        self._reserving = threading.Thread(target=touch, name="lightning_zero-host-buffer", daemon=True)
        self._reserving.start()

    def _join(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def copy(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` with every tensor moved into the buffer (same values, shapes and strides)."""
        if self.user is not None:
            self.user.wait()
            self.user = None
        self._join()
        covered, sizes = self._plan(payload)
        for dtype, nbytes in sizes.items():
            if dtype not in self._flat or self._flat[dtype].numel() < nbytes // _itemsize(dtype):
                self._flat[dtype] = torch.empty(nbytes // _itemsize(dtype), dtype=dtype)
        for dtype in [d for d in self._flat if d not in sizes]:
            del self._flat[dtype]
        with torch.no_grad():
            written: dict[torch.dtype, int] = {}
            for storage, dtype, first, end, start in covered.values():
                flat, size = self._flat[dtype], _itemsize(dtype)
                flat[written.get(dtype, 0) // size : start // size].zero_()  # the alignment gap before the slot
                source = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, first, (end - first,), (1,))
                flat[start // size : start // size + end - first].copy_(source)
                written[dtype] = start + (end - first) * size
            for dtype, nbytes in sizes.items():
                self._flat[dtype][
                    written[dtype] // _itemsize(dtype) : nbytes // _itemsize(dtype)
                ].zero_()  # the last gap
        # what the writer's tensors view: the used part of each flat tensor, as a storage of its own size
        used = {d: exact_storage(self._flat[d][: n // _itemsize(d)]).untyped_storage() for d, n in sizes.items()}

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            _, dtype, first, _, start = covered[(storage.data_ptr(), storage.nbytes())]
            offset = start // _itemsize(dtype) + tensor.storage_offset() - first
            return torch.empty(0, dtype=dtype).set_(used[dtype], offset, tensor.size(), tensor.stride())

        return tree_map_only(torch.Tensor, moved, payload)
