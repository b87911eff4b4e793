"""The engine's side of the disk tier (:mod:`lightning_zero.offload.nvme`): optimizer states
(``offload_optimizer="nvme"``, :class:`EngineSwap`) and stage-3 parameter shards
(``offload_parameters="nvme"``, :class:`ParamTier`), both in the files of one :class:`SwapStore`.

Between steps every offloaded buffer's fp32 master and Adam moments are in swap files; the step
(:class:`~lightning_zero.zero.step_kernels.KernelStep`) streams them. Everything else that reads
or writes them (checkpoint save and load, :meth:`ZeroEngine.publish`) runs inside
:meth:`EngineSwap.resident`, which brings them into host memory for its duration and writes
them back after.

A sharded parameter buffer's ``param_shard`` ((shard_numel,), compute dtype) rests in its file
``param<i>.swp`` with zero bytes of storage. Its life in one step, along the data path:

* **gather** (forward, and again in backward): the gather hooks call :meth:`ParamTier.read_ahead`
  with the buffers of the next modules of the recorded order, which starts their reads while the
  current module computes, at most ``param_buffer_count`` shards in memory; the network prefetch
  only gathers shards whose read was started at an earlier hook (:meth:`ParamTier.ready`: a gate
  of a collective, so the same on every rank, whatever each rank's disk timing). :meth:`ParamTier.load` (from
  :meth:`FlatBuffer.gather_start`) waits for the shard (or reads it now: first step, order
  changed), the gather copies it into the full buffer, and :meth:`ParamTier.unload` frees it at
  once: its file still holds the same values.
* **step**: :meth:`ParamTier.open_for_write` gives the shard memory without reading it (the kernel
  overwrites all of it with the cast master), :meth:`ParamTier.write_behind` writes it while the
  next buffer steps, and the one before it is freed once written; :meth:`ParamTier.flush` frees
  the last.
* anything else that writes shards (:meth:`ZeroEngine.publish` after a checkpoint load,
  ``gathered_parameters(modifier_rank=...)``) goes through :meth:`ParamTier.rewrite`, one buffer
  at a time.

A resume (:meth:`CheckpointSurface.load_pieces`) casts each loaded master into its parameter slice or
shard while the master is in memory, so each master is read from disk once.

While a parameter tier is active released parameters hold empty tensors (not views of their piece
of the shard, which has no memory), so in-place edits of released parameters outside a forward do
not reach the shards: edit them inside ``gathered_parameters``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_zero.config import NvmeConfig, OffloadConfig
from lightning_zero.offload.nvme import Swapped, SwapStore, check_free_space
from lightning_zero.zero.flat import FlatBuffer, ParamState
from lightning_zero.zero.step import ShardedOptimizer
from lightning_zero.zero.step_kernels import KernelStep


def bytes_needed(numel: int, tensors: int, block_size: int, moment_itemsize: int = 4) -> int:
    """Bytes of swap files for a rank whose master slices hold ``numel`` fp32 elements: master,
    exp_avg and exp_avg_sq (``moment_itemsize`` bytes each: 2 for bf16 moments), plus up to one
    ``block_size`` of padding per file (the compiled engine pads files to whole blocks) for at most
    one buffer per parameter tensor (``tensors``)."""
    return (4 + 2 * moment_itemsize) * numel + 3 * block_size * tensors


def param_bytes_needed(numel: int, tensors: int, block_size: int, itemsize: int) -> int:
    """Bytes of parameter swap files for a rank whose shards hold ``numel`` elements of ``itemsize``
    bytes, plus up to one ``block_size`` of padding for at most one buffer per parameter tensor."""
    return itemsize * numel + block_size * tensors


def check_space(
    offload: OffloadConfig,
    module: nn.Module,
    data_parallel_size: int,
    processes_per_machine: int,
    param_itemsize: int = 4,
    optimizers: list[torch.optim.Optimizer] | None = None,
) -> None:
    """Before anything is allocated: the disk tier's files of every rank on this machine (which share
    ``nvme_path``) must fit in its free space; ``ValueError`` otherwise. A no-op without the disk tier.
    ``param_itemsize``: bytes per element of the compute dtype (parameter shards on disk; 4 is an
    upper bound). ``optimizers``: the moments of a parameter whose optimizer keeps them in bf16
    (``KernelStep.moment_itemsize``) count 2 bytes each; without them, or for a parameter in none, 4."""
    nvme = offload.nvme
    if offload.optimizer_tier != "nvme" or nvme is None:
        return

    def per_rank(params: list[nn.Parameter]) -> int:  # elements of one rank's shards of ``params``
        return -(-sum(p.numel() for p in params) // data_parallel_size)

    trainable = [p for p in module.parameters() if p.requires_grad]
    itemsize = {
        id(p): KernelStep.moment_itemsize(o) for o in optimizers or [] for g in o.param_groups for p in g["params"]
    }
    needed = 0
    for moment in sorted({itemsize.get(id(p), 4) for p in trainable}):
        share = [p for p in trainable if itemsize.get(id(p), 4) == moment]
        needed += bytes_needed(per_rank(share), len(share), nvme.block_size, moment)
    # gradient slices (zero/swap_grads.py), in the compute dtype (stage 1 keeps them in memory: counted anyway)
    needed += param_bytes_needed(per_rank(trainable), len(trainable), nvme.block_size, param_itemsize)
    if offload.parameter_tier == "nvme":  # every parameter shard, in the compute dtype
        every = list(module.parameters())
        needed += param_bytes_needed(per_rank(every), len(every), nvme.block_size, param_itemsize)
    check_free_space(nvme, needed * max(1, processes_per_machine))


class EngineSwap:
    """Owns the :class:`SwapStore` of one engine and the kernels that stream through it.

    Args:
        sharded: the engine's sharded optimizers (each must step with the Adam kernel, except those
            with whole-tensor groups: they keep their masters and states in host memory, as with
            ``offload_optimizer="cpu"``, because an owner steps a whole tensor with the optimizer's
            own class, while the files hold flat slices streamed through the kernel).
        store: the rank's swap files (shared with the :class:`ParamTier`, if any).
    """

    def __init__(self, sharded: list[ShardedOptimizer], store: SwapStore) -> None:
        kernels: list[KernelStep] = []
        for s in sharded:
            if s.whole is not None:
                continue
            if s.kernel is None or s.kernel.lamb or s.kernel.kind != "adam":
                raise ValueError(
                    f"offload_optimizer='nvme' streams Adam/AdamW states through the CPU Adam kernel, but "
                    f"{type(s.optimizer).__name__} (with its options) steps otherwise; use torch.optim.Adam/AdamW "
                    "(amsgrad=False, maximize=False) or offload_optimizer=True."
                )
            kernels.append(s.kernel)
            for b in s.buffers:
                # fp32 stage 3 without a separate master: the parameter shard *is* the master tensor.
                # It must stay in memory for the forward, so it gets its own copy.
                b.split_master()
        self.store = store
        self.kernels = kernels
        for o, kernel in enumerate(kernels):
            kernel.swap = self.store
            kernel.swap_prefix = f"opt{o}."  # file names unique per optimizer (two would collide on "0.master")
            for index in range(len(kernel.buffers)):
                for name, tensor in kernel.swapped(index):
                    if not SwapStore.resident(tensor):
                        self.store.rename(tensor, name)  # written by the build (BuildToDisk): its file, renamed
        self.settle()

    def buffers(self) -> list[FlatBuffer]:
        """The flat buffers whose masters and states rest in the swap files."""
        return [b for kernel in self.kernels for b in kernel.buffers]

    def items_of(self, buffer: FlatBuffer, master_only: bool = False) -> list[Swapped]:
        """The swapped tensors of one flat buffer (its master first), ``[]`` for a buffer not stepped here."""
        for kernel in self.kernels:
            for index, b in enumerate(kernel.buffers):
                if b is buffer:
                    items = kernel.swapped(index)
                    return items[:1] if master_only else items
        return []

    @contextmanager
    def resident_buffer(self, buffer: FlatBuffer, master_only: bool = False) -> Iterator[None]:
        """One buffer's master (and states unless ``master_only``) in host memory for the block,
        written back and freed after: what checkpoints use to stream, one buffer at a time."""
        items = self.items_of(buffer, master_only)
        self.store.fetch(items)
        self.store.wait(items)
        try:
            yield
        finally:
            self.store.evict(items)
            self.store.release(items)

    def adopt(self, buffer: FlatBuffer, state: dict[str, torch.Tensor]) -> None:
        """Write a buffer's loaded state slices (``exp_avg``, ...; host tensors about to be given to
        ``optimizer.load_state_dict``) into their swap files and free their memory, so that loading
        an optimizer holds one buffer's states at a time. torch keeps the tensor objects (same dtype
        and device), which then rest on disk like the ones they replace."""
        for kernel in self.kernels:
            for index, b in enumerate(kernel.buffers):
                if b is buffer:
                    items = [(kernel.swap_name(index, key), value) for key, value in state.items()]
                    self.store.evict(items)
                    self.store.release(items)
                    return

    def _items(self) -> list[Swapped]:
        return [item for k in self.kernels for index in range(len(k.buffers)) for item in k.swapped(index)]

    def settle(self) -> None:
        """Write every swapped tensor that has memory to its file and free it (new state tensors take over their files)."""
        items = [item for item in self._items() if SwapStore.resident(item[1])]  # the rest is on disk already
        self.store.evict(items)
        self.store.release(items)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Masters and states in host memory inside the block (blocking reads), back on disk after
        (new state tensors, e.g. from ``optimizer.load_state_dict``, take over their files)."""
        items = self._items()
        self.store.fetch(items)
        self.store.wait(items)
        try:
            yield
        finally:
            self.settle()

    def close(self, bring_back: bool) -> None:
        """Delete the files; with ``bring_back`` first read everything back into host memory."""
        for kernel in self.kernels:
            kernel.swap = None
        self.store.close(bring_back)


class ParamTier:
    """Stage-3 parameter shards in swap files (``offload_parameters="nvme"``); see the module docstring.

    Args:
        buffers: the sharded (non-persistent) buffers, trainable and frozen.
        store: the rank's swap files.
        config: ``param_buffer_count`` bounds the shards read ahead.
    """

    def __init__(self, buffers: list[FlatBuffer], store: SwapStore, config: NvmeConfig) -> None:
        self.store = store
        self.limit = config.param_buffer_count
        self.buffers = buffers
        self._names = {id(b): f"param{i}" for i, b in enumerate(buffers)}
        self._in_memory: dict[int, FlatBuffer] = {}  # shards with storage: read ahead, being read or written
        self._writing: list[FlatBuffer] = []  # written behind, freed once written
        # read_ahead calls so far, and per shard read ahead the call that started its read: what
        # :meth:`ready` decides by (the same on every rank; a read's completion is not)
        self._calls = 0
        self._issued: dict[int, int] = {}
        #: the most shards in memory at once so far (tests and benchmarks read it)
        self.peak = 0
        for b in buffers:
            b.attach_shard_tier(self)  # empty tensors from now on: the shards are about to lose their memory
        items = [self._item(b) for b in buffers if SwapStore.resident(b.param_shard)]
        for b in buffers:
            if not SwapStore.resident(b.param_shard):
                store.rename(b.param_shard, self._names[id(b)])  # written by the build (BuildToDisk)
        store.evict(items)
        store.release(items)

    def _item(self, b: FlatBuffer) -> Swapped:
        return self._names[id(b)], b.param_shard

    def in_memory(self) -> int:
        """How many shards hold memory now: at most ``param_buffer_count`` read ahead plus the one
        being gathered; during the step two (the one stepped, the one written behind)."""
        return len(self._in_memory)

    # -- gather ----------------------------------------------------------------------------------

    def read_ahead(self, upcoming: list[FlatBuffer]) -> None:
        """Start reading the shards of ``upcoming`` (in order of use) that are released and on disk,
        while fewer than ``param_buffer_count`` shards are in memory."""
        self._calls += 1
        for b in upcoming:
            if len(self._in_memory) >= self.limit:
                return
            if b.shard_tier is not self or b.state is not ParamState.RELEASED or id(b) in self._in_memory:
                continue
            self.store.fetch([self._item(b)])
            self._hold(b)
            self._issued[id(b)] = self._calls

    def ready(self, b: FlatBuffer) -> bool:
        """Whether ``b``'s shard may be gathered ahead of its use (the gather hooks' network prefetch):
        its read was started by an earlier :meth:`read_ahead` call than the latest, i.e. it has had at
        least one module's compute to arrive (a gather waits for whatever is still in flight).

        This gates a collective, so it depends only on the sequence of calls, which is the same on
        every rank, never on whether this rank's read has completed: a check of completion let ranks
        start their prefetch all-gathers in different orders, which hung on 2 ranks."""
        return id(b) in self._in_memory and self._issued.get(id(b), self._calls) < self._calls

    def load(self, b: FlatBuffer) -> None:
        """``b.param_shard`` in memory with its values (blocking; a no-op wait when read ahead)."""
        item = self._item(b)
        if not SwapStore.resident(b.param_shard):
            self.store.fetch([item])
            self._hold(b)
        self.store.wait([item])

    def unload(self, b: FlatBuffer) -> None:
        """The gather copied the shard: free its memory (its file holds the same values), unless it
        is being written behind (:meth:`flush` frees it)."""
        if any(b is w for w in self._writing):
            return
        self.store.release([self._item(b)])
        self._in_memory.pop(id(b), None)
        self._issued.pop(id(b), None)

    def end_pass(self) -> None:
        """Free shards read ahead but not gathered (the order changed, or the pass ended)."""
        for b in list(self._in_memory.values()):
            self.unload(b)

    # -- step and other writers ------------------------------------------------------------------

    def open_for_write(self, b: FlatBuffer) -> None:
        """Give ``b.param_shard`` memory for a writer that overwrites all of it (no read)."""
        self.store.wait([self._item(b)])  # a read ahead still in flight
        if not SwapStore.resident(b.param_shard):
            self.store.allocate(b.param_shard)
        self._hold(b)

    def _hold(self, b: FlatBuffer) -> None:
        self._in_memory[id(b)] = b
        self.peak = max(self.peak, len(self._in_memory))

    def write_behind(self, b: FlatBuffer) -> None:
        """Start writing ``b``'s new shard; free the one written before it once that write is done."""
        assert SwapStore.resident(b.param_shard), "a shard without memory cannot be written (nested rewrite?)"
        self.store.evict([self._item(b)])
        self._writing.append(b)
        while len(self._writing) > 1:
            self._free_written(self._writing.pop(0))

    def flush(self) -> None:
        """Wait for every write behind and free those shards."""
        while self._writing:
            self._free_written(self._writing.pop(0))

    def _free_written(self, b: FlatBuffer) -> None:
        self.store.release([self._item(b)])
        self._in_memory.pop(id(b), None)
        self._issued.pop(id(b), None)

    @contextmanager
    def rewrite(self, buffers: list[FlatBuffer]) -> Iterator[None]:
        """The shards of ``buffers`` (of this tier) writable in the block (not read), written after."""
        mine = [b for b in buffers if b.shard_tier is self]
        for b in mine:
            self.open_for_write(b)
        try:
            yield
        finally:
            for b in mine:
                self.write_behind(b)
            self.flush()

    @contextmanager
    def resident_masters(self) -> Iterator[None]:
        """Frozen buffers' shards (their own masters: checkpoints read and load them) in memory for the
        block, written back after."""
        frozen = [b for b in self.buffers if b.master is b.param_shard]
        for b in frozen:
            self.load(b)
        try:
            yield
        finally:
            for b in frozen:
                self.write_behind(b)
            self.flush()

    @contextmanager
    def resident_one(self, b: FlatBuffer) -> Iterator[None]:
        """``b``'s shard in memory with its values for the block (read), written back after."""
        if b.shard_tier is not self:
            yield
            return
        self.load(b)
        try:
            yield
        finally:
            self.write_behind(b)
            self.flush()

    def close(self) -> None:
        """Stop tracking the shard files (the store removes them when closed); the shards keep no memory."""
        self.flush()
        for b in self.buffers:
            b.detach_shard_tier()
        self.store.forget([name for name, _ in map(self._item, self.buffers)])
        self._in_memory.clear()
        self._issued.clear()


class BuildToDisk:
    """Stage 3's sharded build straight into the disk tier: called by
    :func:`~lightning_zero.zero.build.build_sharded` with each sharded buffer as soon as it is built
    (its module just materialized), it writes the buffer's fp32 master (``masters``:
    ``offload_optimizer="nvme"``) and its parameter shard (``params``: ``offload_parameters="nvme"``)
    to files and frees them, and frees the (zero) gradient slice when the gradient tier will hold it
    (``grads``), before the next module is materialized. So a model built in ``configure_model`` is
    never whole in memory: at most one module's full tensors and one buffer's slices are. The files
    are renamed to their owners' names when the tiers take them over (:meth:`SwapStore.rename`).
    The masters and gradient slices of buffers holding parameters in ``in_memory`` (ids: optimizers
    with whole-tensor groups, stepped by their own class on the host) stay in memory.
    """

    def __init__(
        self, store: SwapStore, *, masters: bool, params: bool, grads: bool, in_memory: frozenset[int] = frozenset()
    ) -> None:
        self.store = store
        self.masters, self.params, self.grads = masters, params, grads
        self.in_memory = in_memory
        self.count = 0
        #: bytes of earlier buffers' masters, parameter shards and gradient slices still in memory
        #: when each buffer was written, the most seen (tests read it: 0 when nothing stays behind)
        self.peak_left_behind = 0
        self._built: list[FlatBuffer] = []

    def __call__(self, b: FlatBuffer) -> None:
        left = sum(
            t.untyped_storage().nbytes()
            for w in self._built
            for t in (w.master, w.param_shard, w.grad_shard)
            if t is not None
        )
        self.peak_left_behind = max(self.peak_left_behind, left)
        n, items = self.count, list[Swapped]()
        self.count += 1
        host = any(id(p) in self.in_memory for p in b.params)
        to_disk = self.masters and b.trainable and b.separate_master and not host
        # fp32: the shard stays apart from the master (EngineSwap), which goes to disk, or stays in
        # memory while the shard goes
        if b.trainable and b.separate_master and (to_disk or self.params) and b.split_master():
            b.bind_released()
        if to_disk:
            items.append((f"build{n}.master", b.master))
        if self.params:
            items.append((f"build{n}.param", b.param_shard))
            b.unbind_params()  # not views of a shard about to lose its memory (ParamTier binds the same)
        self.store.evict(items)
        self.store.release(items)
        if self.grads and b.grad_shard is not None and not host:
            b.grad_shard.untyped_storage().resize_(0)  # zero until the first reduction (GradTier)
        self._built.append(b)
