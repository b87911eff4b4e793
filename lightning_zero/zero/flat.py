"""The runtime side of a flat buffer: the tensors of one :class:`~.partition.FlatLayout`, by role.

Roles, for one flat buffer on rank r (N ranks, compute dtype ``c``: fp32, bf16 or fp16)::

    param_shard  (shard_numel,)  c    rank r's slice of the parameters (always present)
    flat_param   (padded_numel,) c    the full parameters; every parameter's ``.data`` is a view into it.
                                      Persistent buffers (stages 1 and 2, and small parameters under
                                      stage 3) keep it, with param_shard a view of its slice r; sharded
                                      buffers (stage 3) have its memory only while gathered (one tensor
                                      whose storage is resized to 0 bytes when released)
    grad_bucket  (padded_numel,) g    full-size gradients collected from autograd for one reduction;
                                      stage 1 keeps it across micro-steps, stages 2/3 free it after each
    grad_shard   (shard_numel,)  g    rank r's slice of the reduced (averaged) gradients; under the
                                      gradient disk tier (zero/swap_grads.py) in a file, with memory
                                      only while reduced into or stepped
    host_grad    (shard_numel,)  g    offload with a GPU: grad_shard's copy in (pinned) host memory, made
                                      as each reduction of stages 2/3 completes
    master       (shard_numel,)  fp32 rank r's slice of the master weights that the optimizer steps;
                                      param_shard itself when c needs no separate master (32-true, bf16-true)

The gradient dtype ``g`` is ``c`` unless ``ZeroConfig.reduce_dtype`` says otherwise (e.g. fp32 sums of
bf16 gradients, as FSDP2's ``reduce_dtype``): autograd's gradient (in ``c``) is added into the
bucket in ``g``, reduced in ``g`` and accumulated over micro-steps in ``g``.

A sharded buffer is in one :class:`ParamState` at a time. While ``RELEASED`` each parameter's
``.data`` is a 1-D view of this rank's piece of it in ``param_shard`` (empty where the rank holds
none; in the parameter's shape where the piece is all of it): reading one as a module attribute
outside its module's forward fails (:mod:`~lightning_zero.zero.gather`), and elementwise in-place
edits land in the shard (and reach the master: :meth:`FlatBuffer.absorb_edits`).
A trainable buffer's gradient roles are in one :class:`GradState` at a time; the methods under
"gradients" are its transitions. :class:`~lightning_zero.zero.reduce.GradReducer` only decides
when each happens (and issues the collectives)::

    EMPTY --receive--> COLLECTING --start_reduce--> REDUCING --finish_reduce--> REDUCED (ON_HOST when offloaded)
                                                       ^                           |
                                                       +-- start_reduce --- ACCUMULATING <-- receive (next backward)
    any state but REDUCING --drop_grads (after the step)--> EMPTY

Stage 1 receives into a bucket kept across steps and reduces once, at the step (COLLECTING ->
REDUCING -> REDUCED); stages 2 and 3 reduce after every backward, so from the second micro-step on a
buffer accumulates (ACCUMULATING: the next reduction is added to ``grad_shard``, not written).

Other modules read the roles and states (read-only properties) and ask for every change through a
method: the reducer for the transitions above, the disk tiers (:mod:`~lightning_zero.zero.swap`,
:mod:`~lightning_zero.zero.swap_grads`) to rest a role in a file (``attach_shard_tier``,
``attach_grad_tier``, ``split_master``), the step to leave ``master.grad`` on disk (``defer_grad``).

The padding at the end of the flat buffer is zero in every role, so norms and optimizer states
computed over whole slices are exact.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import OffloadConfig
from lightning_zero.offload.host import host_copy, host_empty
from lightning_zero.zero.partition import FlatLayout
from lightning_zero.zero.pools import BlockPool, empty_shell, lend, take_back


class ParamState(enum.Enum):
    """Where the full parameters of a sharded flat buffer are."""

    RELEASED = "released"  # only param_shard exists
    GATHERING = "gathering"  # an all-gather into flat_param is in flight
    GATHERED = "gathered"  # flat_param is complete and the parameters are views into it


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


class ShardTier(Protocol):
    """Where ``param_shard`` rests while released when it is not kept in memory: the disk tier
    (:class:`lightning_zero.zero.swap.ParamTier`)."""

    def load(self, b: FlatBuffer) -> None: ...
    def unload(self, b: FlatBuffer) -> None: ...
    def rewrite(self, buffers: list[FlatBuffer]) -> AbstractContextManager[None]: ...
    def open_for_write(self, b: FlatBuffer) -> None: ...
    def write_behind(self, b: FlatBuffer) -> None: ...
    def flush(self) -> None: ...


class GradTierLike(Protocol):
    """Where ``grad_shard`` rests between reductions and the step when it is not kept in memory: the
    disk tier (:class:`lightning_zero.zero.swap_grads.GradTier`)."""

    def before_reduce(self, b: FlatBuffer, fresh: bool) -> None: ...
    def before_add(self, b: FlatBuffer) -> None: ...
    def after_reduce(self, b: FlatBuffer) -> None: ...
    def drop(self, b: FlatBuffer) -> None: ...
    def resident(self, b: FlatBuffer, write: bool) -> AbstractContextManager[None]: ...
    def pending(self, b: FlatBuffer, inv_scale: float) -> PendingGrad: ...
    def squared(self, b: FlatBuffer) -> torch.Tensor: ...
    def read_step_grad(self, b: FlatBuffer) -> torch.Tensor: ...
    def materialize(self, b: FlatBuffer) -> None: ...
    def step_items(self, b: FlatBuffer) -> list[tuple[str, torch.Tensor]]: ...
    def step_grad(self, b: FlatBuffer) -> torch.Tensor: ...
    def kernel_grad(self, b: FlatBuffer) -> tuple[torch.Tensor, float] | None: ...
    def done_step(self, b: FlatBuffer) -> None: ...


class FlatBuffer:
    """One flat buffer: parameters of one optimizer parameter group, one dtype, one reduction bucket.

    Args:
        params: the parameters, in flat-buffer order; their current values are the initial values.
        layout: offsets of ``params`` and the slicing over ranks.
        rank: this rank in the data-parallel group.
        optimizer_group: index of the optimizer parameter group the master slice joins; ``None`` for
            frozen parameters (sharded under stage 3, but without master or gradients).
        dtype: the compute dtype of parameters (and of gradients unless ``grad_dtype`` is given).
        device: where every role lives.
        separate_master: keep an fp32 master slice (mixed precision).
        persistent: keep the full parameters (stages 1/2); False shards them (stage 3).
        offload: an :class:`~lightning_zero.config.OffloadConfig`; with ``offload_optimizer`` the
            fp32 master (and so the optimizer states) lives in host memory, pinned on a GPU machine.
        pool: where a sharded buffer's gathered parameters come from and go back to
            (:mod:`~lightning_zero.zero.pools`); a pool of its own when not given.
        grad_dtype: the dtype of the gradient roles (``ZeroConfig.reduce_dtype``); ``dtype`` when None.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: FlatLayout,
        *,
        rank: int,
        optimizer_group: int | None,
        dtype: torch.dtype,
        device: torch.device,
        separate_master: bool,
        persistent: bool = True,
        offload: OffloadConfig | None = None,
        pool: BlockPool | None = None,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = params
        self.pool = pool if pool is not None else BlockPool()
        self._block: torch.Tensor | None = None  # the pool's block whose memory flat_param holds while gathered
        self.layout = layout
        self.rank = rank
        self.optimizer_group = optimizer_group
        self.dtype = dtype
        self.grad_dtype = grad_dtype or dtype
        self.device = device
        self.persistent = persistent
        self.trainable = optimizer_group is not None
        self.offloaded = bool(offload and offload.offload_optimizer and self.trainable)
        # An offloaded master is always a separate (host) tensor, also for fp32.
        self.separate_master = (separate_master or self.offloaded) and self.trainable
        self.shards = layout.shards(rank)
        start, end = layout.shard_range(rank)

        # The fp32 master is taken from the parameters before they are cast to the compute dtype,
        # so that mixed precision starts from exactly the fp32 initialization.
        # fp32, or fp64 under "64-true" (an fp32 copy would round a float64 model's weights)
        master_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        master = torch.zeros(layout.shard_numel, dtype=master_dtype, device=device)
        for piece in self.shards:
            source = params[piece.param_index].detach().reshape(-1)
            master[piece.shard_offset : piece.shard_offset + piece.numel].copy_(
                source[piece.param_offset : piece.param_offset + piece.numel]
            )
        self._flat_param: torch.Tensor | None = None
        # set by the parameter disk tier (attach_shard_tier): param_shard has memory only while gathered or stepped
        self._shard_tier: ShardTier | None = None
        if persistent:
            self._flat_param = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
            for param, slot in zip(params, layout.slots, strict=True):
                self._flat_param[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
            self._param_shard = self._flat_param[start:end]
            self._state = ParamState.GATHERED
            self.bind_params()
        else:
            # One tensor for the buffer's whole life; memory only while gathered (see release()).
            self._flat_param = empty_shell(layout.padded_numel, dtype, device)
            self._param_shard = master.to(dtype)
            if offload is not None and offload.offload_parameters and self._param_shard.device.type != "cpu":
                self._param_shard = host_copy(self._param_shard, pin=offload.pin_memory)
            self._state = ParamState.GATHERED
            self.release()
        if offload is not None and self.offloaded and master.device.type != "cpu":
            master = host_copy(master, pin=offload.pin_memory)
        self._master = master if self.separate_master else self._param_shard
        self._grad_shard: torch.Tensor | None = (
            torch.zeros(layout.shard_numel, dtype=self.grad_dtype, device=device) if self.trainable else None
        )
        self._grad_bucket: torch.Tensor | None = None
        # Offload: the reduced slice's copy in (pinned) host memory, refreshed as each reduction of
        # stages 2/3 completes so the device-to-host copy overlaps the rest of backward.
        self._host_grad: torch.Tensor | None = None
        if (
            offload is not None
            and self.offloaded
            and self._grad_shard is not None
            and self._grad_shard.device.type != "cpu"
        ):
            self._host_grad = host_empty(layout.shard_numel, self.grad_dtype, pin=offload.pin_memory)
        self._grad_state = GradState.EMPTY
        # set by the gradient disk tier (attach_grad_tier): grad_shard has memory only while reduced into or stepped
        self._grad_tier: GradTierLike | None = None
        # under the gradient disk tier, master.grad while its values rest on disk (defer_grad)
        self._pending_grad: PendingGrad | None = None
        self.arrived: set[int] = set()  # indices of the parameters whose gradient this backward brought
        self._bucket_kept = False  # stage 1: grad_bucket lives across steps and grad_shard is its slice
        self._bucket_adopted = False  # grad_bucket is autograd's own gradient tensor (see adopts())
        self._gather_handle: comm.Handle | None = None

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    # -- roles and states, read-only: they change only through the methods below ----------------

    @property
    def param_shard(self) -> torch.Tensor:
        """(shard_numel,) compute dtype: rank r's slice of the parameters."""
        return self._param_shard

    @property
    def flat_param(self) -> torch.Tensor | None:
        """(padded_numel,) compute dtype: the full parameters (memory only while gathered when sharded)."""
        return self._flat_param

    @property
    def master(self) -> torch.Tensor:
        """(shard_numel,) fp32 (fp64 under "64-true"): the slice the optimizer steps; ``param_shard``
        itself when no separate master is kept."""
        return self._master

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
    def state(self) -> ParamState:
        """Where the full parameters are (:class:`ParamState`)."""
        return self._state

    @property
    def grad_state(self) -> GradState:
        """What the gradient roles hold (:class:`GradState`)."""
        return self._grad_state

    @property
    def shard_tier(self) -> ShardTier | None:
        """The tier ``param_shard`` rests in while released (:meth:`attach_shard_tier`), or None."""
        return self._shard_tier

    @property
    def grad_tier(self) -> GradTierLike | None:
        """The tier ``grad_shard`` rests in between reductions and the step (:meth:`attach_grad_tier`), or None."""
        return self._grad_tier

    @property
    def pending_grad(self) -> PendingGrad | None:
        """Under the gradient tier, ``master.grad`` while its values rest on disk (:meth:`defer_grad`)."""
        return self._pending_grad

    # -- the disk tiers ask, the buffer changes ------------------------------------------------

    def split_master(self) -> bool:
        """Give ``param_shard`` storage of its own where it is the master tensor itself (fp32 without a
        separate master): the optimizer's disk tier moves the master to a file while the shard must
        stay for the forward. Returns whether it split. The parameters are not rebound (see
        :meth:`bind_released`)."""
        # (_cdata: the storage itself; a data pointer is 0 for every storage the build freed)
        if self._param_shard.untyped_storage()._cdata != self._master.untyped_storage()._cdata:
            return False
        self._param_shard = self._master.detach().clone()
        return True

    def attach_shard_tier(self, tier: ShardTier) -> None:
        """A released sharded buffer's ``param_shard`` rests in ``tier`` from now on: the parameters
        hold empty tensors (the shard is about to lose its memory)."""
        assert not self.persistent and self._state is ParamState.RELEASED
        self._shard_tier = tier
        self.bind_released()

    def detach_shard_tier(self) -> None:
        """``param_shard`` no longer rests in a tier (the tier is closing)."""
        self._shard_tier = None

    def attach_grad_tier(self, tier: GradTierLike) -> None:
        """``grad_shard`` rests in ``tier`` between reductions and the step from now on (EMPTY only)."""
        assert self._grad_shard is not None and self._grad_state is GradState.EMPTY
        self._grad_tier = tier

    def detach_grad_tier(self) -> None:
        """``grad_shard`` no longer rests in a tier (the tier is closing); no gradient is left pending."""
        self._grad_tier = None
        self._pending_grad = None

    def defer_grad(self, inv_scale: float) -> None:
        """The step's ``master.grad`` stays on disk under the gradient tier: record it as pending
        (``inv_scale``, and the clipping the step records into it later)."""
        assert self._grad_tier is not None
        self._pending_grad = self._grad_tier.pending(self, inv_scale)

    def drop_pending_grad(self) -> None:
        """The pending ``master.grad`` was used (or read into memory, or the step is over)."""
        self._pending_grad = None

    def unbind_params(self) -> None:
        """Point every parameter at an empty tensor of the compute dtype on the buffer's device (never
        another device or dtype: see :meth:`bind_released`), e.g. before the shard loses its memory."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for param in self.params:
            param.data = empty

    def make_trainable(self, optimizer_group: int, separate_master: bool, offload: OffloadConfig | None) -> None:
        """Stage 3: a frozen buffer joins an optimizer's parameter group added during fit
        (``add_param_group``, Lightning's ``BackboneFinetuning``): it gets the roles a trainable
        buffer is built with, from its own shard (no communication; the same object stays in the
        gather hooks). The master starts from ``param_shard``: under mixed precision a frozen shard
        was kept in the compute dtype, so the master starts from its 16-bit values."""
        assert not self.trainable and self._shard_tier is None
        self.optimizer_group = optimizer_group
        self.trainable = True
        self.offloaded = bool(offload and offload.offload_optimizer)
        self.separate_master = separate_master or self.offloaded
        if self.separate_master:
            master_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            master = self._param_shard.to(device=self.device, dtype=master_dtype, copy=True)
            if offload is not None and self.offloaded and master.device.type != "cpu":
                master = host_copy(master, pin=offload.pin_memory)
            self._master = master
        self._grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        if offload is not None and self.offloaded and self.device.type != "cpu":
            self._host_grad = host_empty(self.layout.shard_numel, self.grad_dtype, pin=offload.pin_memory)

    def bind_params(self) -> None:
        """Make every parameter's ``.data`` a view into ``flat_param`` (identity of the Parameter kept)."""
        assert self._flat_param is not None
        for param, slot in zip(self.params, self.layout.slots, strict=True):
            param.data = self._flat_param[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # -- stage 3: gather and release ------------------------------------------------------------

    def gather_start(self, group: comm.ProcessGroup, label: str = "") -> None:
        """Launch the all-gather of the full parameters (no-op unless released). ``label`` names the
        module it is for (in the collective checker's messages). Call on all ranks."""
        if self._state is not ParamState.RELEASED:
            return
        assert self._flat_param is not None and self._block is None
        self._block = lend(self.pool, self._flat_param)  # the same tensor every time, pooled memory
        start, end = self.layout.shard_range(self.rank)
        own = self._flat_param[start:end]
        if self._shard_tier is not None:
            self._shard_tier.load(self)
        # Writing the parameters back must not count as an in-place edit of the tensors autograd saved
        # from them in forward (views of flat_param): their values are the same as when saved.
        with torch.autograd._unsafe_preserve_version_counter(self._flat_param):
            # With offloaded parameters the shard is in host memory: to the device first (non_blocking
            # from pinned memory; the all-gather is queued after the copy on the same stream). Blocking
            # when the disk tier frees the shard right after.
            own.copy_(self._param_shard, non_blocking=self._shard_tier is None)
            if self._shard_tier is not None:
                self._shard_tier.unload(self)
            self._gather_handle = comm.all_gather(self._flat_param, own, group, async_op=True, label=label)
        self._state = ParamState.GATHERING

    def gather_wait(self) -> None:
        """Complete an in-flight gather and point the parameters at the full buffer."""
        if self._state is ParamState.GATHERING:
            assert self._gather_handle is not None
            self._gather_handle.wait()
            self._gather_handle = None
            self.bind_params()
            self._state = ParamState.GATHERED

    def release(self) -> None:
        """Free the full parameters of a sharded buffer; only ``param_shard`` stays."""
        if self.persistent or self._state is ParamState.RELEASED:
            return
        self.gather_wait()
        self.bind_released()
        # Free the memory, keep the tensor: autograd holds views of flat_param that forward saved for
        # backward (``weight.t()`` of a Linear), which would keep a dropped buffer alive until
        # backward, so every module's full parameters would stay resident from its forward to its
        # backward. The memory goes back to the pool now (flat_param holds 0 bytes); the next gather
        # puts memory into the same storage, and the saved views read the parameters again.
        if self._flat_param is not None:
            take_back(self.pool, self._flat_param, self._block)
            self._block = None
        self._state = ParamState.RELEASED

    def bind_released(self) -> None:
        """Point each parameter of a released buffer at its piece of ``param_shard`` (see
        :meth:`_own_piece`), or at an empty tensor where the shard cannot stand in for it: under a
        :class:`ShardTier` (the shard has memory only while gathered or stepped) and where the shard
        lives on another device or in another dtype than the gathered parameters (parameter offload
        on a GPU: the shard is in host memory). A parameter's data never changes device or dtype:
        autograd drops a leaf's gradient accumulator when it does, so a parameter used twice in one
        forward (tied embeddings) would get two accumulators and two gradient hooks in one backward."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        own = (
            self._shard_tier is None
            and self._param_shard.device == self.device
            and self._param_shard.dtype == self.dtype
        )
        for index, param in enumerate(self.params):
            param.data = self._own_piece(index, empty) if own else empty

    def _own_piece(self, index: int, empty: torch.Tensor) -> torch.Tensor:
        """What parameter ``index`` holds while released: a view of this rank's piece of it in
        ``param_shard`` (1-D; in its own shape when the piece is the whole parameter), so that
        elementwise in-place edits outside forward (``p.data.clamp_(-c, c)`` in a hook) change the
        shard, as they change DDP's parameter; ``empty`` where this rank holds none of it."""
        piece = next((s for s in self.shards if s.param_index == index), None)
        if piece is None:
            return empty
        view = self._param_shard[piece.shard_offset : piece.shard_offset + piece.numel]
        slot = self.layout.slots[index]
        return view.view(slot.shape) if piece.numel == slot.numel else view

    def unshard(self, group: comm.ProcessGroup) -> None:
        """Stage 3 teardown: gather for good; the parameters keep the full buffer. Call on all ranks."""
        if self.persistent:
            return
        self.gather_start(group)
        self.gather_wait()
        self.persistent = True  # release() is a no-op from now on

    # -- gradients and the step -------------------------------------------------------------------

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

    def start_reduce(self, new_bucket: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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

    def finish_reduce(self, out: torch.Tensor, world_size: int, to_host: bool) -> torch.Tensor | None:
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

    def add_to_grads(self, start: int, piece: torch.Tensor) -> None:
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

    def drop_grads(self) -> None:
        """After the step (or instead of one): every gradient role back to zero -> EMPTY."""
        if self._bucket_kept:
            assert self._grad_bucket is not None
            self._grad_bucket.zero_()  # grad_shard is a view of it
        elif self._grad_tier is not None:
            self._grad_tier.drop(self)  # no memory; the file is stale until the next reduction
        elif self._grad_shard is not None:
            self._grad_shard.zero_()
        self._grad_state = GradState.EMPTY

    def window_grads(self) -> tuple[str, torch.Tensor] | None:
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

    def load_window_grads(self, state: str, grads: torch.Tensor) -> None:
        """Put back what :meth:`window_grads` saved (same layout, same rank)."""
        target = self._grad_bucket if self._bucket_kept else self._grad_shard
        assert target is not None and target.shape == grads.shape
        if self._grad_tier is not None:
            with self._grad_tier.resident(self, write=True):  # (still EMPTY: nothing read)
                target.copy_(grads)
        else:
            target.copy_(grads)
        self._grad_state = GradState(state)

    def absorb_edits(self, chunk: int = 1 << 20) -> None:
        """Write in-place edits of parameters into the master (the user's hooks and callbacks edit
        ``param.data``: weight clipping, an EMA swapped in; under stage 3 the released parameters are
        views of this rank's pieces, so elementwise edits land in ``param_shard``). Every element of
        this rank's parameter slice that differs from the cast master is copied into it, so the next
        step starts from the edited value, as under DDP (under mixed precision with the 16-bit value:
        the edit itself was made in 16 bits). One pass over the slice, ``chunk`` elements at a time
        (no slice-sized temporaries, no host synchronization when both live on one device). No-op
        where the master is the parameter slice itself (fp32 without offload)."""
        if not self.separate_master or self._shard_tier is not None:
            # Under the parameter disk tier released parameters are empty (edits cannot reach the
            # shard), and only the step and publish write the shard, from the master.
            return
        device = self._master.device
        chunk = min(chunk, self.layout.shard_numel)
        cast = torch.empty(chunk, dtype=self._param_shard.dtype, device=device)  # reused by every chunk
        edited = torch.empty(chunk, dtype=torch.bool, device=device)
        with torch.no_grad():
            for start in range(0, self.layout.shard_numel, chunk):
                master = self._master[start : start + chunk]
                param = self._param_shard[start : start + chunk].to(device)  # offloaded: a copy to the host
                n = master.numel()
                cast[:n].copy_(master)
                torch.ne(param, cast[:n], out=edited[:n])
                if device.type == "cpu" and not bool(edited[:n].any()):
                    continue  # nothing edited here (on a GPU the check would synchronize the host)
                torch.where(edited[:n], param.to(master.dtype), master, out=master)

    def params_from_master(self) -> None:
        """Overwrite this rank's parameter slice with the master slice (cast), offloaded or not."""
        if self.separate_master:
            self._param_shard.copy_(self._master)
