"""Memory that lives and dies every step, taken from one pool per engine and given back to it.

Two kinds of full-size blocks come and go on the hot path: stage 3's gathered parameters (one
flat buffer's ``flat_param`` from its all-gather to its release) and the gradient buckets of stages
2 and 3 (from a buffer's first gradient of a backward to the end of its reduce-scatter). Asking the
allocator for them every time makes the process's resident memory churn and grow: on CPU a fresh
multi-megabyte allocation page-faults on first touch (measured 77-86 ms for 56 MB against 2.6 ms to
zero a buffer that already exists), and glibc keeps freed blocks of the heap resident in fragments,
so the RSS the OS reports ends well above what is alive (measured at 2 ranks on 8 square 2048
layers, fp32, stage 3: 575 MiB resident over 293 MiB of live tensors). A :class:`BlockPool` keeps
every block given back and hands it out again, keyed by element count, dtype and device (a request
of a size the pool has no block of may take the smallest free block of up to :attr:`BlockPool.FIT`
times its size); after the first
step the pool holds the most blocks a step used at once and nothing is allocated any more
(counted by :attr:`BlockPool.allocations`). Stage 3 gathers and stage 2/3 buckets share one pool:
a buffer's bucket and its gathered parameters have the same size.

Gathered parameters cannot simply be *replaced* by a pooled block: autograd keeps views of
``flat_param`` that forward saved for backward (``weight.t()`` of a Linear). :func:`lend` moves a
block's memory into ``flat_param``'s own storage instead (``UntypedStorage._swap_data_ptr_``, which
exchanges two storages' memory and sizes), so every view sees the gathered values, and
:func:`take_back` moves it out again, leaving ``flat_param`` with 0 bytes. Where that private torch
method is missing, the storage is resized to 0 bytes and back (what FSDP does): correct, but every
gather asks the allocator again.
"""

from __future__ import annotations

import torch

#: ``UntypedStorage._swap_data_ptr_`` exists (torch >= 2.4): gathered parameters can use pooled memory
CAN_LEND = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class BlockPool:
    """Free 1-D blocks by ``(numel, dtype, device)``; every block given back is kept for reuse."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        #: blocks this pool had to allocate (a step in the steady state allocates none)
        self.allocations = 0
        #: bytes of the blocks handed out and not given back yet, and the most of them at once
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        # sizes given up once (see take) and sizes that had to come back after that: kept for good
        self._given_up: set[tuple[int, torch.dtype, torch.device]] = set()
        self._keep: set[tuple[int, torch.dtype, torch.device]] = set()
        #: blocks handed out and not given back yet, by their whole size (see take)
        self._lent: dict[tuple[int, torch.dtype, torch.device], int] = {}

    #: a request may take a free block up to this many times its size (the rest of it idle meanwhile):
    #: measured on the benchmark GPT at stage 3, 27 blocks instead of 29 of exact sizes
    FIT = 4.0

    @property
    def free(self) -> list[torch.Tensor]:
        """The blocks not in use right now (memory accounting)."""
        return [t for blocks in self._free.values() for t in blocks]

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
        """A block of ``numel`` elements (contents undefined unless ``zero``): a free block of that
        size, else the first ``numel`` elements of the smallest free block of at most
        ``FIT * numel`` (buckets and gathers of slightly different sizes share blocks), else a new one.

        A larger block is borrowed only for a size of which no block is out right now. When this
        size's own blocks are all in use, its demand is above what it has, and a borrowed larger
        block only moves the shortage to the larger size: its next request misses and allocates,
        :meth:`_give_up_smaller` then frees the exact blocks, and the pool drifts to larger blocks.
        That happens wherever the sizes taken at a hook are not those given back since the last one
        (measured on the benchmark GPT at stage 3, whose layers gather 288, 864 and 2 x 1152 KiB:
        18.2 MiB kept for 15.4 MiB requested at once at most). Allocating the exact size instead keeps
        16.3 MiB there, what the same model kept before the prefetches started a hook later."""
        device = torch.device(device)
        key = (numel, dtype, device)
        blocks = self._free.get(key)
        if not blocks and not self._lent.get(key):
            fits = [
                k
                for k, free in self._free.items()
                if free and k[1:] == (dtype, device) and numel < k[0] <= self.FIT * numel
            ]
            blocks = self._free[min(fits)] if fits else None
        if blocks:
            block = blocks.pop()[:numel]
            if zero:
                block.zero_()
        else:
            self.allocations += 1
            if key in self._given_up:
                self._keep.add(key)
            self._give_up_smaller(numel, dtype, device)
            block = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
        self.in_use_bytes += block.untyped_storage().nbytes()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        whole = (block.untyped_storage().nbytes() // block.element_size(), dtype, device)
        self._lent[whole] = self._lent.get(whole, 0) + 1
        return block

    def _give_up_smaller(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """On a miss: free blocks too small for ``numel`` that the new block could stand in for
        (at least ``numel / FIT``) go back to the allocator, since the new block serves their
        requests too once it is back. Without this, a bucket that is smaller than the next one and
        done before it keeps a block that is never again the one a request takes first (measured on the
        benchmark GPT at stage 2: 3 blocks, 7.9 MiB, where 2 blocks, 5.6 MiB, were ever in use at
        once). A size given up and then needed again (its request came while the larger block was
        in use) is kept from then on, so the steady state allocates nothing."""
        for key in [k for k, free in self._free.items() if free and k[1:] == (dtype, device)]:
            if self.FIT * key[0] >= numel > key[0] and key not in self._keep:
                self._given_up.add(key)
                del self._free[key]

    def give(self, block: torch.Tensor) -> None:
        """Keep ``block`` (1-D, from the start of its storage, as :meth:`take` handed it out) for reuse:
        all of its storage, whatever part of it was lent."""
        self.in_use_bytes -= block.untyped_storage().nbytes()
        capacity = block.untyped_storage().nbytes() // block.element_size()
        whole = (capacity, block.dtype, block.device)
        self._lent[whole] = self._lent.get(whole, 0) - 1
        if block.numel() != capacity:
            block = block.new_empty(0).set_(block.untyped_storage(), 0, (capacity,), (1,))
        self._free.setdefault((capacity, block.dtype, block.device), []).append(block)

    def clear(self) -> None:
        """Let the allocator have every free block back (teardown)."""
        self._free.clear()


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the memory (and byte sizes) of ``a``'s and ``b``'s storages; views follow their storage."""
    # a private torch API (its presence checked by CAN_LEND), absent from torch's type stubs
    a.untyped_storage()._swap_data_ptr_(b.untyped_storage())  # type: ignore[attr-defined]


def empty_shell(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements whose storage holds 0 bytes: ``flat_param`` while released."""
    shell = torch.empty(numel, dtype=dtype, device=device)
    shell.untyped_storage().resize_(0)
    return shell


def lend(pool: BlockPool, shell: torch.Tensor) -> torch.Tensor | None:
    """Give ``shell`` (0 bytes) a full block's memory; returns the emptied block to hand back to
    :func:`take_back` (``None`` where the memory was allocated instead: see the module docstring)."""
    nbytes = shell.numel() * shell.element_size()
    if not CAN_LEND:
        shell.untyped_storage().resize_(nbytes)
        return None
    block = pool.take(shell.numel(), shell.dtype, shell.device)
    _swap(shell, block)  # shell: the memory; block: 0 bytes
    return block


def take_back(pool: BlockPool, shell: torch.Tensor, block: torch.Tensor | None) -> None:
    """Move ``shell``'s memory back into ``block`` and into the pool; ``shell`` holds 0 bytes after."""
    if block is None:
        shell.untyped_storage().resize_(0)
        return
    _swap(shell, block)
    pool.give(block)
