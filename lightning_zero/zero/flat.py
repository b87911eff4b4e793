"""The runtime side of a flat buffer: the tensors of one :class:`~.partition.FlatLayout`, by role.

Roles, for one flat buffer on rank r (N ranks, compute dtype ``c``: fp32, bf16 or fp16)::

    flat_param   (padded_numel,) c   the full parameters; every parameter's ``.data`` is a view into it
    param_shard  (shard_numel,)  c   view: rank r's slice of flat_param
    grad_bucket  (padded_numel,) c   full-size gradients being gathered from autograd for one reduction;
                                     stage 1 keeps it across micro-steps, stage 2 frees it after each
    grad_shard   (shard_numel,)  c   rank r's slice of the reduced (averaged) gradients
    master       (shard_numel,)  fp32 rank r's slice of the master weights that the optimizer steps;
                                     a view of param_shard when c needs no separate master (32-true, bf16-true)

The padding at the end of the flat buffer is always zero in every role, so norms and optimizer
states computed over whole slices are exact.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_zero.zero.partition import FlatLayout


class FlatBuffer:
    """One flat buffer: a bucket of parameters of one optimizer parameter group and one dtype."""

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: FlatLayout,
        rank: int,
        optimizer_group: int,
        dtype: torch.dtype,
        device: torch.device,
        separate_master: bool,
    ) -> None:
        self.params = params
        self.layout = layout
        self.rank = rank
        self.optimizer_group = optimizer_group
        self.shards = layout.shards(rank)
        start, end = layout.shard_range(rank)

        # The fp32 master is taken from the parameters before they are cast to the compute dtype,
        # so that mixed precision starts from exactly the fp32 initialization.
        self.flat_param = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for param, slot in zip(params, layout.slots):
            self.flat_param[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
        self.param_shard = self.flat_param[start:end]
        if separate_master:
            self.master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
            for piece in self.shards:
                source = params[piece.param_index].detach().reshape(-1)
                self.master[piece.shard_offset : piece.shard_offset + piece.numel].copy_(
                    source[piece.param_offset : piece.param_offset + piece.numel]
                )
        else:
            self.master = self.param_shard
        self.separate_master = separate_master
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.grad_bucket: Optional[torch.Tensor] = None
        # True while grad_shard holds nothing since the last step (stage 2 can then receive the
        # first reduction straight into it instead of adding).
        self.grad_shard_fresh = True
        self.arrived: set[int] = set()
        self.bind_params()

    def bind_params(self) -> None:
        """Make every parameter's ``.data`` a view into ``flat_param`` (identity of the Parameter kept)."""
        for param, slot in zip(self.params, self.layout.slots):
            param.data = self.flat_param[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def bucket(self) -> torch.Tensor:
        """The gradient bucket, allocated zeroed on first use."""
        if self.grad_bucket is None:
            self.grad_bucket = torch.zeros_like(self.flat_param)
        return self.grad_bucket

    @property
    def complete(self) -> bool:
        """Every parameter's gradient of this backward has arrived in the bucket."""
        return len(self.arrived) == len(self.params)

    def publish_master(self) -> None:
        """Write the updated fp32 master slice into this rank's slice of the parameters (cast)."""
        if self.separate_master:
            self.param_shard.copy_(self.master)
