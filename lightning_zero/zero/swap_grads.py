"""Gradients on the disk tier (``offload_optimizer="nvme"``, stages 2 and 3, gradients in host memory),
as DeepSpeed's optimizer swapper swaps gradient partitions.

Without it every trainable flat buffer keeps its reduced ``grad_shard`` ((shard_numel,), compute
dtype) in memory from backward to the step, and the step turns all of them into fp32
``master.grad`` at once: 6 bytes per parameter of the rank's slice alive together under
bf16-mixed (2 + 4), whatever the optimizer states' tier. With a :class:`GradTier` each
``grad_shard`` rests in its file ``<key>.grad`` with zero bytes of storage, along the data path:

* **reduce** (:meth:`FlatBuffer.start_reduce` / :meth:`FlatBuffer.finish_reduce`): the first
  reduction of a window writes into ``grad_shard`` given fresh memory (nothing read); a later one
  (gradient accumulation) starts reading the file while the collective runs and adds into it
  (read-add-write: RAM stays bounded while accumulating too). Once reduced, the slice's sum of
  squares is taken (:func:`squared_norm`, in fp32, exactly as the step's norm takes it from
  ``master.grad``), the slice is
  written behind and its memory freed once written; at most ``buffer_count`` writes are waited for
  lazily, the rest when backward ends (:meth:`GradTier.flush`).
* **step** (:meth:`ShardedOptimizer.prepare`): ``master.grad`` is not built; each buffer gets a
  :class:`PendingGrad` (its ``inv_scale``, its sum of squares, and the clipping applied since). The
  global norm adds the sums of squares (no read) while nothing was applied yet; after clipping it
  re-reads (exact either way). Clipping by norm or value is recorded, not applied. The kernel step
  reads each buffer's gradient with its master and moments (read ahead ``buffer_count - 1``
  sub-groups, :class:`~lightning_zero.zero.step_kernels.KernelStep`), casts it to fp32 for that
  sub-group only, applies ``inv_scale`` and the recorded clipping in the order the old path did, and
  frees it after the kernel. A bf16 slice with at most one factor to apply (``inv_scale``, or one
  clipping by norm) goes to the compiled Adam kernel as it is, the factor as its ``grad_scale``
  (:meth:`GradTier.kernel_grad`): the kernel widens it in registers, one product per element as
  the cast-then-multiply makes, without the fp32 copy (4 bytes per element written and read again,
  the step's largest cost after the I/O). The arithmetic and its order are those of the in-memory
  path, so the results are bitwise equal.
* anything that needs the values elsewhere (``full_gradients``, a checkpoint in the middle of an
  accumulation window, gradients of parameters tied across pipeline stages) goes through
  :meth:`GradTier.resident` (one buffer at a time) or :meth:`GradTier.materialize` (all of them into
  ``master.grad``, the old memory cost, only while such a feature is used).

RAM for gradients: the buckets being reduced (at most two) plus at most ``buffer_count`` slices
being written, during backward; during the step, the read-ahead sub-groups' slices and one fp32 copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lightning_zero.config import NvmeConfig
from lightning_zero.offload.nvme import Swapped, SwapStore
from lightning_zero.ops.functional import cpu_sum_squares
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.flat_grads import GradState, PendingGrad


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of squares the step's global norm adds up for one slice, in fp32 (fp64 for fp64
    tensors), for the in-memory path (``master.grad``) and the disk tier (the reduced bf16 slice)
    alike. On the host: :func:`lightning_zero.ops.functional.cpu_sum_squares` (the compiled kernel
    reads a bf16 slice once, widening it in registers: no fp32 copy), which gives a bf16 slice and
    its fp32 cast the same bits, so the tiers take bitwise the same norm. On a device: one
    ``vector_norm`` over the tensor."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    flat = tensor.reshape(-1)
    if flat.device.type != "cpu":
        return torch.linalg.vector_norm(flat, dtype=dtype).square()
    return cpu_sum_squares(flat)


def step_dtype(b: FlatBuffer) -> torch.dtype:
    """The dtype of ``master.grad`` (the master's)."""
    return b.master.dtype


@dataclass(frozen=True)
class Scale:
    """A recorded ``grad.mul_(factor)`` (clipping by norm: ``factor`` a 0-dim tensor); the Adam kernel
    can take it as its ``grad_scale``."""

    factor: torch.Tensor

    def __call__(self, grad: torch.Tensor) -> None:
        grad.mul_(self.factor.to(grad.dtype))


class GradTier:
    """The gradient slices of ``buffers`` in swap files; see the module docstring.

    Args:
        buffers: trainable flat buffers whose ``grad_shard`` is in host memory (stages 2 and 3).
        store: the rank's swap files (shared with the optimizer-state and parameter tiers).
        config: ``buffer_count`` bounds the slices written behind.
    """

    def __init__(self, buffers: list[FlatBuffer], store: SwapStore, config: NvmeConfig) -> None:
        self.store = store
        self.limit = config.buffer_count
        self.buffers = buffers
        self._names = {id(b): f"grad{i}" for i, b in enumerate(buffers)}
        self._writing: list[FlatBuffer] = []
        #: the most gradient slices in memory at once so far, and the most reduction buckets alive
        #: when it was counted (tests read them: peak <= buffer_count + buckets)
        self.peak = 0
        self.peak_buckets = 0
        #: slices the step gave the kernel as they are (:meth:`kernel_grad`; tests read it)
        self.direct = 0
        self._squared: dict[int, torch.Tensor] = {}
        for b in buffers:
            assert b.grad_shard is not None and store.is_host(b.grad_shard) and b.grad_state is GradState.EMPTY
            b.attach_grad_tier(self)
            b.grad_shard.untyped_storage().resize_(0)  # EMPTY: zero, nothing to keep

    def item(self, b: FlatBuffer) -> Swapped:
        assert b.grad_shard is not None
        return self._names[id(b)], b.grad_shard

    def in_memory(self) -> int:
        return sum(1 for b in self.buffers if b.grad_shard is not None and SwapStore.resident(b.grad_shard))

    def _count(self) -> None:
        self.peak = max(self.peak, self.in_memory())
        self.peak_buckets = max(self.peak_buckets, sum(1 for b in self.buffers if b.grad_bucket is not None))

    # -- reduce ----------------------------------------------------------------------------------

    def before_reduce(self, b: FlatBuffer, fresh: bool) -> None:
        """A reduction of ``b`` starts: ``grad_shard`` gets memory (fresh: written whole by the
        reduction, nothing read; accumulating: its file is read while the collective runs)."""
        assert b.grad_shard is not None
        item = self.item(b)
        self.store.wait([item])  # its last write
        if fresh:
            if not SwapStore.resident(b.grad_shard):
                self.store.allocate(b.grad_shard)
        else:
            self.store.fetch([item])
        self._count()

    def before_add(self, b: FlatBuffer) -> None:
        """Accumulating: the earlier sum is read (blocking; issued by :meth:`before_reduce`)."""
        self.store.wait([self.item(b)])

    def after_reduce(self, b: FlatBuffer) -> None:
        """``grad_shard`` holds the window's sum so far: take its sum of squares, write it behind, free
        the oldest written slices beyond ``buffer_count``."""
        assert b.grad_shard is not None
        self._squared[id(b)] = self._squared_norm(b)
        self.store.evict([self.item(b)])
        self._writing.append(b)
        while len(self._writing) > self.limit:
            self._free(self._writing.pop(0))

    def _squared_norm(self, b: FlatBuffer) -> torch.Tensor:
        """The sum of squares of ``b.grad_shard`` cast to the master's dtype: bitwise what the step's
        norm takes from ``master.grad`` (:func:`squared_norm`)."""
        assert b.grad_shard is not None and step_dtype(b) in (torch.float32, torch.float64)  # offloaded masters
        return squared_norm(b.grad_shard)

    def _free(self, b: FlatBuffer) -> None:
        self.store.release([self.item(b)])

    def flush(self) -> None:
        """End of backward: wait for every write behind and free those slices."""
        while self._writing:
            self._free(self._writing.pop(0))

    def drop(self, b: FlatBuffer) -> None:
        """After the step (or ``zero_grad``): the slice is zero; its file is stale until the next reduction."""
        if any(w is b for w in self._writing):
            self._writing = [w for w in self._writing if w is not b]
        self._free(b)
        self._squared.pop(id(b), None)

    # -- step ------------------------------------------------------------------------------------

    def pending(self, b: FlatBuffer, inv_scale: float) -> PendingGrad:
        """``b``'s gradient for the step, left on disk (:class:`PendingGrad`)."""
        if b.grad_state is GradState.EMPTY:
            return PendingGrad(inv_scale, None, zero=True)
        assert b.grad_state is GradState.REDUCED, b.grad_state
        return PendingGrad(inv_scale, self._squared.get(id(b)))

    def step_items(self, b: FlatBuffer) -> list[Swapped]:
        """What the step reads for ``b``'s gradient (nothing for a zero one)."""
        pending = b.pending_grad
        return [] if pending is None or pending.zero else [self.item(b)]

    def step_grad(self, b: FlatBuffer) -> torch.Tensor:
        """``b``'s ``master.grad`` values (its read must be complete): cast, unscaled, clipped."""
        pending = b.pending_grad
        assert pending is not None and b.grad_shard is not None
        if pending.zero:
            grad = torch.zeros(b.grad_shard.shape, dtype=step_dtype(b))
        else:
            grad = b.grad_shard.to(step_dtype(b))  # the grad_for_step cast (no copy when the dtypes match)
        if pending.inv_scale != 1.0:
            grad.mul_(pending.inv_scale)
        for op in pending.ops:
            op(grad)
        return grad

    def kernel_grad(self, b: FlatBuffer) -> tuple[torch.Tensor, float] | None:
        """``b``'s gradient as the compiled Adam kernel takes it without an fp32 copy (its read must be
        complete): the bf16 slice itself and the one factor the step applies to it (``inv_scale`` or
        one :class:`Scale`; 1.0 when none). ``None`` when it needs :meth:`step_grad`: a zero or
        non-bf16 slice, a non-fp32 master, a clamp, or more than one factor (two roundings)."""
        pending = b.pending_grad
        assert pending is not None and b.grad_shard is not None
        if pending.zero or b.grad_shard.dtype != torch.bfloat16 or step_dtype(b) != torch.float32:
            return None
        factors = [] if pending.inv_scale == 1.0 else [pending.inv_scale]
        for op in pending.ops:
            if not isinstance(op, Scale):
                return None
            factors.append(float(op.factor.to(torch.float32)))
        if len(factors) > 1:
            return None
        self.direct += 1
        return b.grad_shard, factors[0] if factors else 1.0

    def read_step_grad(self, b: FlatBuffer) -> torch.Tensor:
        """:meth:`step_grad` with a blocking read, as a tensor of its own; the slice's memory is freed."""
        items = self.step_items(b)
        self.store.fetch(items)
        self.store.wait(items)
        try:
            grad = self.step_grad(b)
            return grad.clone() if b.grad_shard is not None and grad.data_ptr() == b.grad_shard.data_ptr() else grad
        finally:
            self.store.release(items)

    def squared(self, b: FlatBuffer) -> torch.Tensor:
        """The sum of squares of ``b``'s ``master.grad`` as the step will use it (read again only
        when clipping or unscaling has changed it since it was reduced)."""
        pending = b.pending_grad
        assert pending is not None
        if pending.inv_scale == 1.0 and not pending.ops:
            if pending.zero:
                return torch.zeros((), dtype=step_dtype(b))
            if pending.squared is not None:
                return pending.squared
        return squared_norm(self.read_step_grad(b))

    def done_step(self, b: FlatBuffer) -> None:
        """The kernel used ``b``'s gradient: free its memory (the file is stale from now on)."""
        self.store.release(self.step_items(b))

    def materialize(self, b: FlatBuffer) -> None:
        """``b.master.grad`` as a tensor in memory (the old path's memory), the pending record dropped."""
        if b.pending_grad is None:
            return
        b.master.grad = self.read_step_grad(b)
        b.drop_pending_grad()

    # -- other readers and writers ------------------------------------------------------------------

    @contextmanager
    def resident(self, b: FlatBuffer, write: bool) -> Iterator[None]:
        """``b.grad_shard`` with its values in memory for the block (zero when EMPTY); with ``write``
        written back after (and its sum of squares taken again), freed either way."""
        assert b.grad_shard is not None
        item = self.item(b)
        self.store.wait([item])
        if b.grad_state is GradState.EMPTY:
            self.store.allocate(b.grad_shard)
            b.grad_shard.zero_()
        else:
            self.store.fetch([item])
            self.store.wait([item])
        try:
            yield
        finally:
            if write:
                self._squared[id(b)] = self._squared_norm(b)
                self.store.evict([item])
            self._free(b)

    def close(self, bring_back: bool) -> None:
        """Stop using the files. With ``bring_back`` every slice gets zeroed memory again (the window
        is over: gradients were dropped after the last step), so the engine works as without the tier."""
        self.flush()
        self.store.forget(self._names.values())
        for b in self.buffers:
            b.detach_grad_tier()
            assert b.grad_shard is not None
            if bring_back and not SwapStore.resident(b.grad_shard):
                b.grad_shard.untyped_storage().resize_(b.grad_shard.numel() * b.grad_shard.element_size())
                b.grad_shard.zero_()
