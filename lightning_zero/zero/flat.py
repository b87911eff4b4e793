"""The runtime side of a flat buffer: the tensors of one :class:`~.partition.FlatLayout`, by role.

Roles, for one flat buffer on rank r (N ranks, compute dtype ``c``: fp32, bf16 or fp16)::

    param_shard  (shard_numel,)  c    rank r's slice of the parameters (always present)
    flat_param   (padded_numel,) c    the full parameters; every parameter's ``.data`` is a view into it.
                                      Persistent buffers (stages 1 and 2, and small parameters under
                                      stage 3) keep it, with param_shard a view of its slice r; sharded
                                      buffers (stage 3) have it only while gathered
    grad_bucket  (padded_numel,) c    full-size gradients collected from autograd for one reduction;
                                      stage 1 keeps it across micro-steps, stages 2/3 free it after each
    grad_shard   (shard_numel,)  c    rank r's slice of the reduced (averaged) gradients
    master       (shard_numel,)  fp32 rank r's slice of the master weights that the optimizer steps;
                                      param_shard itself when c needs no separate master (32-true, bf16-true)

A sharded buffer is in one :class:`ParamState` at a time. While ``RELEASED`` its parameters'
``.data`` are empty tensors (shape ``(0,)``): reading one outside its module's forward fails.
The padding at the end of the flat buffer is zero in every role, so norms and optimizer states
computed over whole slices are exact.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import OffloadConfig
from lightning_zero.zero.host import host_copy, host_empty
from lightning_zero.zero.partition import FlatLayout


class ParamState(enum.Enum):
    """Where the full parameters of a sharded flat buffer are."""

    RELEASED = "released"  # only param_shard exists
    GATHERING = "gathering"  # an all-gather into flat_param is in flight
    GATHERED = "gathered"  # flat_param is complete and the parameters are views into it


class FlatBuffer:
    """One flat buffer: parameters of one optimizer parameter group, one dtype, one reduction bucket.

    Args:
        params: the parameters, in flat-buffer order; their current values are the initial values.
        layout: offsets of ``params`` and the slicing over ranks.
        rank: this rank in the data-parallel group.
        optimizer_group: index of the optimizer parameter group the master slice joins; ``None`` for
            frozen parameters (sharded under stage 3, but without master or gradients).
        dtype: the compute dtype of parameters and gradients.
        device: where every role lives.
        separate_master: keep an fp32 master slice (mixed precision).
        persistent: keep the full parameters (stages 1/2); False shards them (stage 3).
        offload: an :class:`~lightning_zero.config.OffloadConfig`; with ``offload_optimizer`` the
            fp32 master (and so the optimizer states) lives in host memory, pinned on a GPU machine.
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
    ) -> None:
        self.params = params
        self.layout = layout
        self.rank = rank
        self.optimizer_group = optimizer_group
        self.dtype = dtype
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
        master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        for piece in self.shards:
            source = params[piece.param_index].detach().reshape(-1)
            master[piece.shard_offset : piece.shard_offset + piece.numel].copy_(
                source[piece.param_offset : piece.param_offset + piece.numel]
            )
        self.flat_param: torch.Tensor | None = None
        if persistent:
            self.flat_param = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
            for param, slot in zip(params, layout.slots, strict=True):
                self.flat_param[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
            self.param_shard = self.flat_param[start:end]
            self.state = ParamState.GATHERED
            self.bind_params()
        else:
            self.param_shard = master.to(dtype)
            if offload is not None and offload.offload_parameters and self.param_shard.device.type != "cpu":
                self.param_shard = host_copy(self.param_shard, pin=offload.pin_memory)
            self.state = ParamState.GATHERED
            self.release()
        if self.offloaded and master.device.type != "cpu":
            master = host_copy(master, pin=offload.pin_memory)  # type: ignore[union-attr]
        self.master = master if self.separate_master else self.param_shard
        self.grad_shard: torch.Tensor | None = (
            torch.zeros(layout.shard_numel, dtype=dtype, device=device) if self.trainable else None
        )
        self.grad_bucket: torch.Tensor | None = None
        # Offload: the reduced slice's copy in (pinned) host memory, refreshed as each reduction of
        # stages 2/3 completes so the device-to-host copy overlaps the rest of backward.
        self.host_grad: torch.Tensor | None = None
        if self.offloaded and self.grad_shard is not None and self.grad_shard.device.type != "cpu":
            self.host_grad = host_empty(layout.shard_numel, dtype, pin=offload.pin_memory)  # type: ignore[union-attr]
        self.host_grad_current = False
        # True while grad_shard holds nothing since the last step (the first reduction can then be
        # received straight into it instead of added).
        self.grad_shard_fresh = True
        self.arrived: set[int] = set()
        self._gather_handle: comm.Handle | None = None

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    def bind_params(self) -> None:
        """Make every parameter's ``.data`` a view into ``flat_param`` (identity of the Parameter kept)."""
        assert self.flat_param is not None
        for param, slot in zip(self.params, self.layout.slots, strict=True):
            param.data = self.flat_param[slot.offset : slot.offset + slot.numel].view(slot.shape)

    # -- stage 3: gather and release ------------------------------------------------------------

    def gather_start(self, group: comm.ProcessGroup, label: str = "") -> None:
        """Launch the all-gather of the full parameters (no-op unless released). ``label`` names the
        module it is for (in the collective checker's messages). Call on all ranks."""
        if self.state is not ParamState.RELEASED:
            return
        self.flat_param = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        start, end = self.layout.shard_range(self.rank)
        own = self.flat_param[start:end]
        # With offloaded parameters the shard is in host memory: to the device first (non_blocking
        # from pinned memory; the all-gather is queued after the copy on the same stream).
        own.copy_(self.param_shard, non_blocking=True)
        self._gather_handle = comm.all_gather(self.flat_param, own, group, async_op=True, label=label)
        self.state = ParamState.GATHERING

    def gather_wait(self) -> None:
        """Complete an in-flight gather and point the parameters at the full buffer."""
        if self.state is ParamState.GATHERING:
            assert self._gather_handle is not None
            self._gather_handle.wait()
            self._gather_handle = None
            self.bind_params()
            self.state = ParamState.GATHERED

    def release(self) -> None:
        """Free the full parameters of a sharded buffer; only ``param_shard`` stays."""
        if self.persistent or self.state is ParamState.RELEASED:
            return
        self.gather_wait()
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for param in self.params:
            param.data = empty
        self.flat_param = None
        self.state = ParamState.RELEASED

    def unshard(self, group: comm.ProcessGroup) -> None:
        """Stage 3 teardown: gather for good; the parameters keep the full buffer. Call on all ranks."""
        if self.persistent:
            return
        self.gather_start(group)
        self.gather_wait()
        self.persistent = True  # release() is a no-op from now on

    # -- gradients and the step -------------------------------------------------------------------

    def bucket(self) -> torch.Tensor:
        """The gradient bucket, allocated zeroed on first use."""
        if self.grad_bucket is None:
            self.grad_bucket = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        return self.grad_bucket

    @property
    def complete(self) -> bool:
        """Every parameter's gradient of this backward has arrived in the bucket."""
        return len(self.arrived) == len(self.params)

    def params_from_master(self) -> None:
        """Overwrite this rank's parameter slice with the master slice (cast), offloaded or not."""
        if self.separate_master:
            self.param_shard.copy_(self.master)
