"""The engine's side of the disk tier (``offload_optimizer="nvme"``, :mod:`lightning_zero.offload.nvme`).

Between steps every offloaded buffer's fp32 master and Adam moments are in swap files; the step
(:class:`~lightning_zero.zero.step_kernels.KernelStep`) streams them. Everything else that reads
or writes them (checkpoint save and load, :meth:`ZeroEngine.publish`) runs inside
:meth:`EngineSwap.resident`, which brings them into host memory for its duration and writes
them back after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from lightning_zero.config import NvmeConfig, OffloadConfig
from lightning_zero.offload.nvme import Swapped, SwapStore, check_free_space
from lightning_zero.zero.step import ShardedOptimizer
from lightning_zero.zero.step_kernels import KernelStep


def bytes_needed(numel: int, tensors: int, block_size: int) -> int:
    """Bytes of swap files for a rank whose master slices hold ``numel`` fp32 elements: master,
    exp_avg and exp_avg_sq, plus up to one ``block_size`` of padding per file (the compiled engine
    pads files to whole blocks) for at most one buffer per parameter tensor (``tensors``)."""
    return 3 * 4 * numel + 3 * block_size * tensors


def check_space(offload: OffloadConfig, module: nn.Module, data_parallel_size: int, processes_per_machine: int) -> None:
    """Before anything is allocated: the disk tier's files of every rank on this machine (which share
    ``nvme_path``) must fit in its free space; ``ValueError`` otherwise. A no-op without the disk tier."""
    nvme = offload.nvme
    if offload.optimizer_tier != "nvme" or nvme is None:
        return
    trainable = [p for p in module.parameters() if p.requires_grad]
    per_rank = bytes_needed(
        -(-sum(p.numel() for p in trainable) // data_parallel_size), len(trainable), nvme.block_size
    )
    check_free_space(nvme, per_rank * max(1, processes_per_machine))


class EngineSwap:
    """Owns the :class:`SwapStore` of one engine and the kernels that stream through it.

    Args:
        sharded: the engine's sharded optimizers (each must step with the Adam kernel).
        config: path and I/O knobs.
        rank: global rank.
    """

    def __init__(self, sharded: list[ShardedOptimizer], config: NvmeConfig, rank: int) -> None:
        kernels: list[KernelStep] = []
        for s in sharded:
            if s.kernel is None or s.kernel.lamb or s.kernel.kind != "adam":
                raise ValueError(
                    f"offload_optimizer='nvme' streams Adam/AdamW states through the CPU Adam kernel, but "
                    f"{type(s.optimizer).__name__} (with its options) steps otherwise; use torch.optim.Adam/AdamW "
                    "(amsgrad=False, maximize=False) or offload_optimizer=True."
                )
            kernels.append(s.kernel)
            for b in s.buffers:
                if b.param_shard.untyped_storage().data_ptr() == b.master.untyped_storage().data_ptr():
                    # fp32 stage 3 without a separate master: the parameter shard *is* the master
                    # tensor. It must stay in memory for the forward, so it gets its own copy.
                    b.param_shard = b.master.detach().clone()
        self.store = SwapStore(config, rank)
        self.kernels = kernels
        for kernel in kernels:
            kernel.swap = self.store
        self._write_all()

    def _items(self) -> list[Swapped]:
        return [item for k in self.kernels for index in range(len(k.buffers)) for item in k.swapped(index)]

    def _write_all(self) -> None:
        items = self._items()
        self.store.evict(items)
        self.store.release(items)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Masters and states in host memory inside the block (blocking reads), back on disk after
        (new state tensors, e.g. from ``optimizer.load_state_dict``, take over their files)."""
        self.store.fetch_all()
        try:
            yield
        finally:
            self._write_all()

    def close(self, bring_back: bool) -> None:
        """Delete the files; with ``bring_back`` first read everything back into host memory."""
        for kernel in self.kernels:
            kernel.swap = None
        self.store.close(bring_back)
