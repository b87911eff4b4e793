"""The only module that calls ``torch.distributed`` collectives.

Each function takes its process group explicitly, returns early when the group has one rank (or
when no process group exists), and labels itself for the profiler as ``lightning_zero::<name>``.
Functions with ``async_op=True`` return a :class:`Handle` whose ``wait()`` must be called before the
output is read. Every function here is a collective: call it on all ranks of ``group``, in the same
order, with the same shapes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

ProcessGroup = Optional[dist.ProcessGroup]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An in-flight collective; ``wait()`` blocks until its output may be read."""

    def __init__(self, work: Optional[dist.Work] = None) -> None:
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


_DONE = Handle()


def world_size(group: ProcessGroup) -> int:
    """Ranks in ``group`` (1 without an initialized process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup) -> int:
    """This process's rank within ``group`` (0 without an initialized process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def reduce_scatter(shard_out: torch.Tensor, full_in: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Handle:
    """Sum ``full_in`` (numel = world * shard numel) over ranks; rank r receives chunk r in ``shard_out``.

    Call on all ranks. With one rank this is a copy.
    """
    if world_size(group) == 1:
        shard_out.copy_(full_in)
        return _DONE
    with record_function("lightning_zero::reduce_scatter"):
        return Handle(_reduce_scatter_flat(shard_out, full_in, group=group, async_op=async_op))


def all_gather(full_out: torch.Tensor, shard_in: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Handle:
    """Concatenate every rank's ``shard_in`` into ``full_out`` (rank order).

    ``shard_in`` may be rank r's own chunk of ``full_out`` (in place). Call on all ranks.
    """
    if world_size(group) == 1:
        if full_out.data_ptr() != shard_in.data_ptr():
            full_out.copy_(shard_in)
        return _DONE
    with record_function("lightning_zero::all_gather"):
        return Handle(_all_gather_flat(full_out, shard_in, group=group, async_op=async_op))


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False) -> Handle:
    """Reduce ``tensor`` in place over ``group`` (sum by default). Call on all ranks."""
    if world_size(group) == 1:
        return _DONE
    with record_function("lightning_zero::all_reduce"):
        return Handle(dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src_rank_in_group: int, group: ProcessGroup) -> None:
    """Overwrite ``tensor`` on every rank with the one of group rank ``src_rank_in_group``. Call on all ranks."""
    if world_size(group) == 1:
        return
    with record_function("lightning_zero::broadcast"):
        src = dist.get_global_rank(group, src_rank_in_group) if group is not None else src_rank_in_group
        dist.broadcast(tensor, src=src, group=group)


def broadcast_tensors(tensors: list[torch.Tensor], group: ProcessGroup) -> None:
    """Make every tensor equal to group rank 0's; one collective per dtype. Call on all ranks."""
    if world_size(group) == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        broadcast(flat, 0, group)
        offset = 0
        for t in group_tensors:
            t.data.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def all_gather_object(obj: object, group: ProcessGroup) -> list:
    """Every rank's picklable ``obj``, in rank order. Call on all ranks (slow: metadata only)."""
    if world_size(group) == 1:
        return [obj]
    out: list = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
