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
A trainable buffer's gradient roles are in one :class:`~lightning_zero.zero.flat_grads.GradState` at
a time; the methods of :class:`~lightning_zero.zero.flat_grads.GradRoles` (a mixin of
:class:`FlatBuffer`, with the state diagram) are its transitions.

Other modules read the roles and states (read-only properties) and ask for every change through a
method: the reducer for the gradient transitions, the disk tiers (:mod:`~lightning_zero.zero.swap`,
:mod:`~lightning_zero.zero.swap_grads`) to rest a role in a file (``attach_shard_tier``,
``attach_grad_tier``, ``split_master``), the step to leave ``master.grad`` on disk (``defer_grad``).

The padding at the end of the flat buffer is zero in every role, so norms and optimizer states
computed over whole slices are exact.
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import OffloadConfig
from lightning_zero.offload.host import host_copy, host_empty
from lightning_zero.zero.flat_grads import GradRoles, GradState, PendingGrad
from lightning_zero.zero.partition import FlatLayout
from lightning_zero.zero.pools import BlockPool, empty_shell, lend, take_back


class ParamState(enum.Enum):
    """Where the full parameters of a sharded flat buffer are."""

    RELEASED = "released"  # only param_shard exists
    GATHERING = "gathering"  # an all-gather into flat_param is in flight
    GATHERED = "gathered"  # flat_param is complete and the parameters are views into it


class ShardTier(Protocol):
    """Where ``param_shard`` rests while released when it is not kept in memory: the disk tier
    (:class:`lightning_zero.zero.swap.ParamTier`)."""

    def load(self, b: FlatBuffer) -> None: ...
    def unload(self, b: FlatBuffer) -> None: ...
    def rewrite(self, buffers: list[FlatBuffer]) -> AbstractContextManager[None]: ...
    def open_for_write(self, b: FlatBuffer) -> None: ...
    def write_behind(self, b: FlatBuffer) -> None: ...
    def flush(self) -> None: ...


class FlatBuffer(GradRoles):
    """One flat buffer: parameters of one optimizer parameter group, one dtype, one reduction bucket.
    The gradient roles and their transitions come from :class:`~lightning_zero.zero.flat_grads.GradRoles`.

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
        self._grad_tier = None
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
    def state(self) -> ParamState:
        """Where the full parameters are (:class:`ParamState`)."""
        return self._state

    @property
    def shard_tier(self) -> ShardTier | None:
        """The tier ``param_shard`` rests in while released (:meth:`attach_shard_tier`), or None."""
        return self._shard_tier

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

    # -- the master and the parameters ------------------------------------------------------------

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
