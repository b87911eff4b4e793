"""Autograd functions that move activations in and out of a tensor-parallel region, in mirrored pairs.

As in Megatron-LM's ``tensor_parallel/mappings.py``: each forward collective has the other one of
its pair as backward, so the gradient of a replicated input is complete on every rank and the
gradient of a sharded output reaches only the rank that owns it. The pairs::

    copy_to_tensor_parallel        forward: identity        backward: all-reduce (sum)
    reduce_from_tensor_parallel    forward: all-reduce      backward: identity
    scatter_last_dim               forward: take own chunk  backward: all-gather along the last dim
    gather_last_dim                forward: all-gather      backward: take own chunk

Every function returns its input unchanged (and adds no autograd node) when the group has one rank.
The collectives themselves are in :mod:`lightning_zero.comm`; every function here is a collective:
call it on all ranks of ``group``, in the same order, with the same shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero import comm


def _all_reduce(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce in place into a tensor autograd may have saved
    comm.all_reduce(out, group, label="tensor_parallel")
    return out


def _own_chunk(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    size, rank = comm.world_size(group), comm.rank(group)
    if x.shape[-1] % size:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    size = comm.world_size(group)
    x = x.contiguous()
    gathered = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)  # (T, ..., d/T)
    comm.all_gather(gathered.view(-1), x.view(-1), group, label="tensor_parallel")
    return torch.cat(gathered.unbind(0), dim=-1)  # (..., d)


class _CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity; backward: all-reduce. Pair of :class:`_ReduceFromTensorParallel`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce; backward: identity. Pair of :class:`_CopyToTensorParallel`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    """Forward: this rank's chunk of the last dim; backward: all-gather. Pair of :class:`_GatherLastDim`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _own_chunk(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather along the last dim; backward: own chunk. Pair of :class:`_ScatterLastDim`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _own_chunk(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated ``x`` (any shape): forward identity,
    backward all-reduce (pair: :func:`reduce_from_tensor_parallel`). Call on all ranks."""
    return x if comm.world_size(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results ``x`` (any shape): forward
    all-reduce, backward identity (pair: :func:`copy_to_tensor_parallel`). Call on all ranks."""
    return x if comm.world_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


def scatter_last_dim(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """(..., d) -> (..., d/T), this rank's chunk; backward all-gathers (pair: :func:`gather_last_dim`).
    Call on all ranks."""
    return x if comm.world_size(group) == 1 else _ScatterLastDim.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """(..., d/T) -> (..., d), chunks in group-rank order; backward keeps this rank's chunk
    (pair: :func:`scatter_last_dim`). Call on all ranks."""
    return x if comm.world_size(group) == 1 else _GatherLastDim.apply(x, group)
