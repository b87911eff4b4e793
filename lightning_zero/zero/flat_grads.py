"""The gradient side of a flat buffer (a mixin of :class:`~lightning_zero.zero.flat.FlatBuffer`): the
roles ``grad_bucket``, ``grad_shard`` and ``host_grad`` (see the table in :mod:`~lightning_zero.zero.flat`),
their :class:`GradState`, and the methods that are its only transitions.
:class:`~lightning_zero.zero.reduce.GradReducer` only decides when each happens (and issues the
collectives)::

    EMPTY --receive--> COLLECTING --start_reduce--> REDUCING --finish_reduce--> REDUCED (ON_HOST when offloaded)
                                                       ^                           |
                                                       +-- start_reduce --- ACCUMULATING <-- receive (next backward)
    any state but REDUCING --drop_grads (after the step)--> EMPTY

Stage 1 receives into a bucket kept across steps and reduces once, at the step (COLLECTING ->
REDUCING -> REDUCED); stages 2 and 3 reduce after every backward, so from the second micro-step on a
buffer accumulates (ACCUMULATING: the next reduction is added to ``grad_shard``, not written).

Under the gradient disk tier (:mod:`~lightning_zero.zero.swap_grads`, a :class:`GradTierLike`
attached with :meth:`GradRoles.attach_grad_tier`) ``grad_shard`` has memory only while reduced into
or stepped, and the step's ``master.grad`` may stay on disk (:class:`PendingGrad`,
:meth:`GradRoles.defer_grad`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

from lightning_zero.zero.partition import FlatLayout

if TYPE_CHECKING:
    from typing_extensions import Self


class GradState(enum.Enum):
    """What the gradient roles of a trainable flat buffer hold between two optimizer steps."""

    EMPTY = "empty"  # grad_shard is zero since the last step (the first reduction writes straight into it)
    COLLECTING = "collecting"  # grad_bucket receives this backward's gradients; grad_shard is still zero
    ACCUMULATING = "accumulating"  # as COLLECTING, over a grad_shard holding earlier backwards' sums
    REDUCING = "reducing"  # the bucket's reduce-scatter is in flight
    REDUCED = "reduced"  # grad_shard holds the averaged gradients of every backward since the step
    ON_HOST = "on_host"  # REDUCED, and host_grad a copy of it (complete once the reducer's event fired)


# A gradient arriving: what the state becomes (REDUCING cannot receive: the reducer refuses first).
_ON_RECEIVE = {
    GradState.EMPTY: GradState.COLLECTING,
    GradState.COLLECTING: GradState.COLLECTING,
    GradState.ACCUMULATING: GradState.ACCUMULATING,
    GradState.REDUCED: GradState.ACCUMULATING,
    GradState.ON_HOST: GradState.ACCUMULATING,
}


@dataclass
class PendingGrad:
    """``master.grad`` of one buffer while its values rest in the gradient file (the gradient disk
    tier, :mod:`~lightning_zero.zero.swap_grads`): the step computes ``grad_shard`` cast to the
    master's dtype, times ``inv_scale`` (when not 1), then ``ops`` in order."""

    inv_scale: float
    squared: torch.Tensor | None
    """The sum of squares of the cast slice, taken when it was reduced (valid while ``ops`` is empty
    and ``inv_scale`` is 1); None: the slice is zero (no gradient since the last step)."""
    zero: bool = False
    ops: list[Callable[[torch.Tensor], object]] = field(default_factory=list)


#: the buffer a gradient tier is given (a FlatBuffer)
_Buffer = TypeVar("_Buffer", contravariant=True)


class GradTierLike(Protocol[_Buffer]):
    """Where ``grad_shard`` rests between reductions and the step when it is not kept in memory: the
    disk tier (:class:`lightning_zero.zero.swap_grads.GradTier`). Generic in the buffer it is given (a
    :class:`~lightning_zero.zero.flat.FlatBuffer`, which this module cannot name: flat.py imports it)."""

    def before_reduce(self, b: _Buffer, fresh: bool) -> None: ...
    def before_add(self, b: _Buffer) -> None: ...
    def after_reduce(self, b: _Buffer) -> None: ...
    def drop(self, b: _Buffer) -> None: ...
    def resident(self, b: _Buffer, write: bool) -> AbstractContextManager[None]: ...
    def pending(self, b: _Buffer, inv_scale: float) -> PendingGrad: ...
    def squared(self, b: _Buffer) -> torch.Tensor: ...
    def read_step_grad(self, b: _Buffer) -> torch.Tensor: ...
    def materialize(self, b: _Buffer) -> None: ...
    def step_items(self, b: _Buffer) -> list[tuple[str, torch.Tensor]]: ...
    def step_grad(self, b: _Buffer) -> torch.Tensor: ...
    def kernel_grad(self, b: _Buffer) -> tuple[torch.Tensor, float] | None: ...
    def done_step(self, b: _Buffer) -> None: ...


class GradRoles:
    """The gradient roles of a flat buffer, read-only, and their transitions (see the module
    docstring). :class:`~lightning_zero.zero.flat.FlatBuffer` builds them; its ``__init__`` sets every
    attribute declared here. The methods that hand the buffer to its gradient tier take ``self: Self``,
    so that the tier is given the buffer's own class (a ``FlatBuffer``), as :class:`GradTierLike` says."""

    params: list[nn.Parameter]
    layout: FlatLayout
    rank: int
    device: torch.device
    grad_dtype: torch.dtype
    trainable: bool
    offloaded: bool
    separate_master: bool
    arrived: set[int]
    _master: torch.Tensor
    _grad_shard: torch.Tensor | None
    _grad_bucket: torch.Tensor | None
    _host_grad: torch.Tensor | None
    _grad_state: GradState
    _grad_tier: GradTierLike[Self] | None
    _pending_grad: PendingGrad | None
    _bucket_kept: bool
    _bucket_adopted: bool

    # -- roles and state, read-only: they change only through the methods below ------------------

    @property
    def grad_shard(self) -> torch.Tensor | None:
        """(shard_numel,) gradient dtype: rank r's slice of the reduced gradients; None when frozen."""
        return self._grad_shard

    @property
    def grad_bucket(self) -> torch.Tensor | None:
        """(padded_numel,) gradient dtype: the gradients collected for one reduction, if any."""
        return self._grad_bucket

    @property
    def host_grad(self) -> torch.Tensor | None:
        """(shard_numel,) gradient dtype: ``grad_shard``'s host copy (offload with a GPU), else None."""
        return self._host_grad

    @property
    def grad_state(self) -> GradState:
        """What the gradient roles hold (:class:`GradState`)."""
        return self._grad_state

    @property
    def grad_tier(self) -> GradTierLike[Self] | None:
        """The tier ``grad_shard`` rests in between reductions and the step (:meth:`attach_grad_tier`), or None."""
        return self._grad_tier

    @property
    def pending_grad(self) -> PendingGrad | None:
        """Under the gradient tier, ``master.grad`` while its values rest on disk (:meth:`defer_grad`)."""
        return self._pending_grad

    # -- the gradient disk tier asks, the buffer changes ---------------------------------------

    def attach_grad_tier(self, tier: GradTierLike[Self]) -> None:
        """``grad_shard`` rests in ``tier`` between reductions and the step from now on (EMPTY only)."""
        assert self._grad_shard is not None and self._grad_state is GradState.EMPTY
        self._grad_tier = tier

    def detach_grad_tier(self) -> None:
        """``grad_shard`` no longer rests in a tier (the tier is closing); no gradient is left pending."""
        self._grad_tier = None
        self._pending_grad = None

    def defer_grad(self: Self, inv_scale: float) -> None:
        """The step's ``master.grad`` stays on disk under the gradient tier: record it as pending
        (``inv_scale``, and the clipping the step records into it later)."""
        assert self._grad_tier is not None
        self._pending_grad = self._grad_tier.pending(self, inv_scale)

    def drop_pending_grad(self) -> None:
        """The pending ``master.grad`` was used (or read into memory, or the step is over)."""
        self._pending_grad = None

    # -- gradients: the transitions ------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every parameter's gradient of this backward has arrived."""
        return len(self.arrived) == len(self.params)

    def keep_bucket(self) -> None:
        """Stage 1: a zeroed bucket that accumulates over every micro-step and is reduced in place,
        ``grad_shard`` being its slice r (the 2 bytes of full gradients of the ZeRO formula)."""
        self._grad_bucket = torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=self.device)
        start, end = self.layout.shard_range(self.rank)
        self._grad_shard = self._grad_bucket[start:end]
        self._bucket_kept = True

    def arrive(self, p_index: int) -> None:
        """Parameter ``p_index``'s gradient of this backward is accounted for (in the bucket or elsewhere)."""
        self.arrived.add(p_index)

    def receive(self, p_index: int, grad: torch.Tensor, new_bucket: Callable[[], torch.Tensor]) -> None:
        """Add parameter ``p_index``'s gradient into ``grad_bucket`` (taken from ``new_bucket`` when
        there is none): EMPTY -> COLLECTING, REDUCED/ON_HOST -> ACCUMULATING."""
        assert self._grad_state is not GradState.REDUCING, "a gradient arrived while its bucket is being reduced"
        slot = self.layout.slots[p_index]
        if self._grad_bucket is None and self.adopts(grad):
            self._grad_bucket = grad.view(-1)
            self._bucket_adopted = True
        else:
            if self._grad_bucket is None:
                self._grad_bucket = new_bucket()
            self._grad_bucket[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1))
        self._grad_state = _ON_RECEIVE[self._grad_state]
        self.arrive(p_index)

    def adopts(self, grad: torch.Tensor) -> bool:
        """Stages 2/3: whether autograd's ``grad`` can be this buffer's bucket itself, with no copy and
        no block from the pool: the buffer holds one parameter and no padding (a parameter larger
        than ``reduce_bucket_size`` is a buffer of its own), and ``grad`` owns all of its storage in
        the bucket's dtype, device and layout. The caller gives up ``param.grad`` right after (the
        reduction then overwrites the tensor in place). Saves the copy, and the block of the
        parameter's size that the pool would otherwise keep for every step: the 12 MiB embedding of
        the 13.8M benchmark GPT, each 16 MiB layer of the square benchmark model."""
        if self._bucket_kept or len(self.params) != 1 or grad.numel() != self.layout.padded_numel:
            return False
        if grad.dtype != self.grad_dtype or grad.device != self.device or not grad.is_contiguous():
            return False
        storage = grad.untyped_storage()
        return grad.storage_offset() == 0 and storage.nbytes() == grad.numel() * grad.element_size()

    def start_reduce(self: Self, new_bucket: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> REDUCING. Returns ``(bucket, out)``: the reduce-scatter's input (a zero bucket from
        ``new_bucket`` when no gradient arrived) and output: ``grad_shard`` itself while it holds
        nothing, else a temporary that :meth:`finish_reduce` adds."""
        if self._grad_bucket is None:
            self._grad_bucket = new_bucket()
        assert self._grad_shard is not None and self._grad_state is not GradState.REDUCING
        fresh = self._grad_state in (GradState.EMPTY, GradState.COLLECTING)
        if self._grad_tier is not None:
            self._grad_tier.before_reduce(self, fresh)  # memory (fresh) or the earlier sum's read
        out = self._grad_shard if fresh else torch.empty_like(self._grad_shard)
        self._grad_state = GradState.REDUCING
        return self._grad_bucket, out

    def finish_reduce(self: Self, out: torch.Tensor, world_size: int, to_host: bool) -> torch.Tensor | None:
        """The reduction into ``out`` completed: average it into ``grad_shard`` -> REDUCED, and with
        ``to_host`` start the copy to ``host_grad`` when offloaded -> ON_HOST (pinned memory: the
        copy overlaps what follows). Returns the bucket to recycle (``None`` when kept)."""
        assert self._grad_shard is not None and self._grad_state is GradState.REDUCING
        # Average after the sum: one pass over the slice, not the whole bucket (none for one rank).
        if out is self._grad_shard:
            if world_size > 1:
                self._grad_shard.div_(world_size)
        else:
            if self._grad_tier is not None:
                self._grad_tier.before_add(self)
            self._grad_shard.add_(out.div_(world_size) if world_size > 1 else out)
        self._grad_state = GradState.REDUCED
        if self._grad_tier is not None:
            self._grad_tier.after_reduce(self)  # sum of squares, written behind
        if to_host and self._host_grad is not None:
            self._host_grad.copy_(self._grad_shard, non_blocking=True)
            self._grad_state = GradState.ON_HOST
        if self._bucket_kept:
            return None
        bucket, self._grad_bucket = self._grad_bucket, None
        if self._bucket_adopted:  # autograd's tensor, not the pool's: let it go
            self._bucket_adopted = False
            return None
        return bucket

    def end_backward(self) -> None:
        """Forget which gradients this backward brought (the next one starts counting afresh)."""
        self.arrived.clear()

    def add_to_grads(self: Self, start: int, piece: torch.Tensor) -> None:
        """Add ``piece`` into the reduced gradient slice from element ``start`` on (and into its host
        copy when that is current): gradients reduced outside the buckets (tied parameters)."""
        assert self._grad_shard is not None
        if self._grad_tier is not None:
            with self._grad_tier.resident(self, write=True):
                self._grad_shard[start : start + piece.numel()].add_(piece)
            return
        self._grad_shard[start : start + piece.numel()].add_(piece)
        if self._grad_state is GradState.ON_HOST and self._host_grad is not None:
            self._host_grad[start : start + piece.numel()].add_(piece.to(self._host_grad.device))

    def grad_for_step(self) -> torch.Tensor:
        """The reduced slice as the optimizer's ``master.grad``: fp32 where the master is separate,
        in host memory when offloaded (the host copy made during backward when there is one)."""
        assert self._grad_shard is not None
        master_dtype = self._master.dtype  # fp32, or float64 (a float64 parameter kept under "32-true")
        if self._grad_state is GradState.ON_HOST and self._host_grad is not None:
            return self._host_grad.to(master_dtype)  # copied during backward (the engine waited for it)
        if self.offloaded:
            return self._grad_shard.to(device="cpu", dtype=master_dtype)  # to the host master
        if self.separate_master:
            return self._grad_shard.to(master_dtype)
        # the master is param_shard: a reduce_dtype other than its dtype is cast to it
        return (
            self._grad_shard
            if self._grad_shard.dtype == self._master.dtype
            else self._grad_shard.to(self._master.dtype)
        )

    def drop_grads(self: Self) -> None:
        """After the step (or instead of one): every gradient role back to zero -> EMPTY."""
        if self._bucket_kept:
            assert self._grad_bucket is not None
            self._grad_bucket.zero_()  # grad_shard is a view of it
        elif self._grad_tier is not None:
            self._grad_tier.drop(self)  # no memory; the file is stale until the next reduction
        elif self._grad_shard is not None:
            self._grad_shard.zero_()
        self._grad_state = GradState.EMPTY

    def window_grads(self: Self) -> tuple[str, torch.Tensor] | None:
        """The gradients this buffer holds in the middle of an accumulation window, for a checkpoint:
        ``(GradState value, host copy)`` of ``grad_bucket`` (stage 1: this rank's unreduced sums) or
        ``grad_shard`` (stages 2/3: the averaged slice); ``None`` when EMPTY. Between backwards only
        (not REDUCING). ON_HOST is saved as REDUCED: ``host_grad`` is a copy of ``grad_shard``."""
        if not self.trainable or self._grad_state is GradState.EMPTY:
            return None
        assert self._grad_state is not GradState.REDUCING, "a checkpoint in the middle of a reduction"
        source = self._grad_bucket if self._bucket_kept else self._grad_shard
        assert source is not None
        state = GradState.REDUCED if self._grad_state is GradState.ON_HOST else self._grad_state
        if self._grad_tier is not None:
            with self._grad_tier.resident(self, write=False):
                return state.value, source.detach().to("cpu", copy=True)
        return state.value, source.detach().to("cpu", copy=True)

    def load_window_grads(self: Self, state: str, grads: torch.Tensor) -> None:
        """Put back what :meth:`window_grads` saved (same layout, same rank)."""
        target = self._grad_bucket if self._bucket_kept else self._grad_shard
        assert target is not None and target.shape == grads.shape
        if self._grad_tier is not None:
            with self._grad_tier.resident(self, write=True):  # (still EMPTY: nothing read)
                target.copy_(grads)
        else:
            target.copy_(grads)
        self._grad_state = GradState(state)
