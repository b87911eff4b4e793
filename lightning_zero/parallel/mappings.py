"""Autograd functions that move activations in and out of a tensor-parallel region, in mirrored pairs.

As in Megatron-LM's ``tensor_parallel/mappings.py``: each forward collective has the other one of
its pair as backward, so the gradient of a replicated input is complete on every rank and the
gradient of a sharded output reaches only the rank that owns it. The pairs::

    copy_to_tensor_parallel        forward: identity        backward: all-reduce (sum)
    reduce_from_tensor_parallel    forward: all-reduce      backward: identity
    scatter_last_dim               forward: take own chunk  backward: all-gather along the last dim
    gather_last_dim                forward: all-gather      backward: take own chunk

Sequence parallelism (Megatron-SP, arXiv 2205.05198) moves activations along the sequence dimension
``dim`` (1 for the (batch, seq, hidden) activations of this project's models) instead::

    scatter_to_sequence_parallel        forward: take own chunk   backward: all-gather
    gather_from_sequence_parallel       forward: all-gather       backward: reduce-scatter
    reduce_scatter_to_sequence_parallel forward: reduce-scatter   backward: all-gather

The last two are each other's pair and replace ``copy_to``/``reduce_from`` around a column/row pair:
an all-gather plus a reduce-scatter move as many bytes as one all-reduce, while the activations
between the pairs (LayerNorm, dropout, residual) are stored and computed once per sequence chunk.

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


def _own_chunk_of(x: torch.Tensor, group: comm.ProcessGroup, dim: int) -> torch.Tensor:
    size = comm.world_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"sequence length {x.shape[dim]} (dimension {dim} of {tuple(x.shape)}) is not divisible by the "
            f"tensor-parallel size {size}, which sequence parallelism splits it over; pad or crop the sequences"
        )
    return x.chunk(size, dim=dim)[comm.rank(group)].contiguous()


def _gather_along(x: torch.Tensor, group: comm.ProcessGroup, dim: int) -> torch.Tensor:
    """(..., n, ...) chunks -> (..., T n, ...) along ``dim``, in group-rank order."""
    front = x.movedim(dim, 0).contiguous()  # chunks along dim 0 are contiguous in the gathered buffer
    gathered = torch.empty((comm.world_size(group) * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(gathered.view(-1), front.view(-1), group, label="sequence_parallel")
    return gathered.movedim(0, dim)


def _reduce_scatter_along(x: torch.Tensor, group: comm.ProcessGroup, dim: int) -> torch.Tensor:
    """(..., T n, ...) partial sums -> this rank's (..., n, ...) chunk of their sum over the group."""
    _own_chunk_of(x, group, dim)  # the divisibility check, with its message
    front = x.movedim(dim, 0).contiguous()
    shard = torch.empty((front.shape[0] // comm.world_size(group), *front.shape[1:]), dtype=x.dtype, device=x.device)
    # A copy of x may be overwritten (gloo's faster path); x itself never (autograd may hold it).
    comm.reduce_scatter(
        shard.view(-1), front.view(-1), group, clobber_input=front.data_ptr() != x.data_ptr(), label="sequence_parallel"
    )
    return shard.movedim(0, dim)


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


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Forward: own chunk along ``dim``; backward: all-gather along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_chunk_of(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_along(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: reduce-scatter. Pair of :class:`_ReduceScatterToSequenceParallel`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather_along(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter_along(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``; backward: all-gather. Pair of :class:`_GatherFromSequenceParallel`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_along(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_along(grad, ctx.group, ctx.dim), None, None


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


def scatter_to_sequence_parallel(x: torch.Tensor, group: comm.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Enter the sequence-parallel region from a replicated ``x``: (..., S, ...) -> this rank's
    (..., S/T, ...) along ``dim``; backward all-gathers. Call on all ranks."""
    return x if comm.world_size(group) == 1 else _ScatterToSequenceParallel.apply(x, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group: comm.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """(..., S/T, ...) -> (..., S, ...) along ``dim`` before a column-parallel layer; backward
    reduce-scatters the partial gradients (pair: :func:`reduce_scatter_to_sequence_parallel`). Call on all ranks."""
    return x if comm.world_size(group) == 1 else _GatherFromSequenceParallel.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: comm.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Partial sums (..., S, ...) after a row-parallel layer -> this rank's (..., S/T, ...) of their sum;
    backward all-gathers (pair: :func:`gather_from_sequence_parallel`). Call on all ranks."""
    return x if comm.world_size(group) == 1 else _ReduceScatterToSequenceParallel.apply(x, group, dim)


def all_reduce_gradient(param: torch.Tensor, group: comm.ProcessGroup) -> None:
    """Sum every gradient computed for ``param`` over ``group`` before it is accumulated: for a
    replicated parameter used on one sequence chunk per rank (LayerNorm under sequence parallelism),
    whose gradient on each rank is then a partial sum. A hook on the leaf; the hooks of all ranks
    run in the same backward order. No-op with one rank."""
    if comm.world_size(group) > 1:
        param.register_hook(lambda grad: _all_reduce(grad, group))
