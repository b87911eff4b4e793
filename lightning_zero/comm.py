"""The only module that calls ``torch.distributed`` collectives.

Each function takes its process group explicitly, returns early when the group has one rank (or
when no process group exists), and labels itself for the profiler as ``lightning_zero::<name>``.
Functions with ``async_op=True`` return a :class:`Handle` whose ``wait()`` must be called before the
output is read. Every function here is a collective: call it on all ranks of ``group``, in the same
order, with the same shapes.

A :class:`CheckedGroup` (``ZeroStrategy(debug_collectives=True)``) goes wherever a group goes; the
functions here compare each call across its ranks before issuing it (:mod:`lightning_zero.debug`).
The optional ``label`` says what a call is for (stage 3: the module being gathered) in that
comparison's error message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


@dataclass(frozen=True)
class CheckedGroup:
    """``group`` whose collectives ``checker`` (a :class:`lightning_zero.debug.CollectiveChecker`)
    compares across ranks before they are issued."""

    group: dist.ProcessGroup | None
    checker: Any  # not typed here: lightning_zero.debug imports this module


ProcessGroup = dist.ProcessGroup | CheckedGroup | None

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """In-flight collectives; ``wait()`` blocks until the output may be read, then runs ``then``."""

    def __init__(self, *works: dist.Work | None, then: Callable[[], None] | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._then = then

    def is_completed(self) -> bool:
        """True when ``wait()`` would not block (never blocks itself)."""
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            then()


_DONE = Handle()


def _plain(group: ProcessGroup) -> dist.ProcessGroup | None:
    return group.group if isinstance(group, CheckedGroup) else group


def _checked(group: ProcessGroup, op: str, label: str, *tensors: torch.Tensor) -> dist.ProcessGroup | None:
    """The plain group; for a :class:`CheckedGroup`, after comparing this call across its ranks."""
    if isinstance(group, CheckedGroup):
        group.checker.check(op, tensors, label)
        return group.group
    return group


def initialized() -> bool:
    """True once the default process group exists (``False`` before ``fit`` starts the ranks' group)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup) -> int:
    """Ranks in ``group`` (1 without an initialized process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(_plain(group))


def rank(group: ProcessGroup) -> int:
    """This process's rank within ``group`` (0 without an initialized process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(_plain(group))


def _is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(_plain(group)) == "gloo"


def is_plain_gloo(group: ProcessGroup) -> bool:
    """``group`` is an initialized gloo group of more than one rank without a collective checker
    (host tensors travel on it without a device synchronization). Not a collective."""
    return initialized() and not isinstance(group, CheckedGroup) and world_size(group) > 1 and _is_gloo(group)


def reduce_scatter(
    shard_out: torch.Tensor,
    full_in: torch.Tensor,
    group: ProcessGroup,
    async_op: bool = False,
    clobber_input: bool = False,
    label: str = "",
) -> Handle:
    """Sum ``full_in`` (numel = world * shard numel) over ranks; rank r receives chunk r in ``shard_out``.

    ``shard_out`` may be rank r's own chunk of ``full_in`` (in place). With ``clobber_input`` the
    whole of ``full_in`` may be overwritten: on gloo, whose reduce-scatter copies its input and
    runs about twice as slow as its all-reduce (measured on 56 MB, 2 ranks: 159 vs 80 ms), this is
    then an in-place all-reduce plus a copy of chunk r. Call on all ranks. With one rank: a copy.
    """
    if world_size(group) == 1:
        if shard_out.data_ptr() != full_in.data_ptr():
            shard_out.copy_(full_in[: shard_out.numel()])
        return _DONE
    group = _checked(group, "reduce_scatter", label, shard_out, full_in)
    with record_function("lightning_zero::reduce_scatter"):
        if clobber_input and _is_gloo(group):
            r, n = rank(group), shard_out.numel()
            chunk = full_in[r * n : (r + 1) * n]

            def take_chunk() -> None:
                if shard_out.data_ptr() != chunk.data_ptr():
                    shard_out.copy_(chunk)

            work = dist.all_reduce(full_in, group=group, async_op=async_op)
            handle = Handle(work, then=take_chunk)
            if not async_op:
                handle.wait()
            return handle
        return Handle(_reduce_scatter_flat(shard_out, full_in, group=group, async_op=async_op))


def all_gather(
    full_out: torch.Tensor, shard_in: torch.Tensor, group: ProcessGroup, async_op: bool = False, label: str = ""
) -> Handle:
    """Concatenate every rank's ``shard_in`` into ``full_out`` (rank order).

    ``shard_in`` may be rank r's own chunk of ``full_out`` (in place). Call on all ranks.
    """
    if world_size(group) == 1:
        if full_out.data_ptr() != shard_in.data_ptr():
            full_out.copy_(shard_in)
        return _DONE
    group = _checked(group, "all_gather", label, full_out, shard_in)
    with record_function("lightning_zero::all_gather"):
        if _is_gloo(group):
            # gloo's all-gather into one tensor measured 231-267 ms on 56 MB against 43 ms for one
            # broadcast per rank of its chunk: use the broadcasts.
            n, size = shard_in.numel(), world_size(group)
            own = full_out[rank(group) * n : (rank(group) + 1) * n]
            if own.data_ptr() != shard_in.data_ptr():
                own.copy_(shard_in)
            works = [
                dist.broadcast(full_out[r * n : (r + 1) * n], src=_global(group, r), group=group, async_op=async_op)
                for r in range(size)
            ]
            return Handle(*works)
        return Handle(_all_gather_flat(full_out, shard_in, group=group, async_op=async_op))


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
) -> Handle:
    """Reduce ``tensor`` in place over ``group`` (sum by default). Call on all ranks."""
    if world_size(group) == 1:
        return _DONE
    group = _checked(group, f"all_reduce({op})", label, tensor)
    with record_function("lightning_zero::all_reduce"):
        return Handle(dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def _global(group: ProcessGroup, rank_in_group: int) -> int:
    plain = _plain(group)
    return dist.get_global_rank(plain, rank_in_group) if plain is not None else rank_in_group


def broadcast(tensor: torch.Tensor, src_rank_in_group: int, group: ProcessGroup, label: str = "") -> None:
    """Overwrite ``tensor`` on every rank with the one of group rank ``src_rank_in_group``. Call on all ranks."""
    if world_size(group) == 1:
        return
    group = _checked(group, f"broadcast(from {src_rank_in_group})", label, tensor)
    with record_function("lightning_zero::broadcast"):
        dist.broadcast(tensor, src=_global(group, src_rank_in_group), group=group)


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


def broadcast_each(
    tensors: list[torch.Tensor], src_rank_in_group: int, group: ProcessGroup, bucket_bytes: int = 1 << 25
) -> None:
    """Overwrite each tensor in place with group rank ``src_rank_in_group``'s, holding at most about
    ``bucket_bytes`` besides them: consecutive small tensors of one dtype go in one flat buffer (one
    collective, not one per BatchNorm statistic), a contiguous tensor as big as a bucket goes alone
    without a copy. The tensors' shapes and dtypes must be equal across ranks. Call on all ranks."""
    if world_size(group) == 1 or not tensors:
        return
    batch: list[torch.Tensor] = []

    def flush() -> None:
        if len(batch) == 1 and batch[0].is_contiguous():
            broadcast(batch[0], src_rank_in_group, group, label="broadcast_each")
        elif batch:
            flat = torch.cat([t.reshape(-1) for t in batch])
            broadcast(flat, src_rank_in_group, group, label="broadcast_each")
            offset = 0
            for t in batch:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        batch.clear()

    size = 0
    for tensor in tensors:
        t = tensor.detach()  # a parameter's values, written in place without autograd
        nbytes = t.numel() * t.element_size()
        if batch and (t.dtype != batch[0].dtype or t.device != batch[0].device or size + nbytes > bucket_bytes):
            flush()
            size = 0
        batch.append(t)
        size += nbytes
    flush()


def broadcast_buffers(buffers: list[torch.Tensor], group: ProcessGroup, bucket_bytes: int = 250 << 20) -> None:
    """DDP's ``broadcast_buffers``: overwrite every module buffer (BatchNorm running statistics, step
    counters) with group rank 0's, coalesced as DDP does: buffers of one dtype and device in flat
    buckets of up to ``bucket_bytes`` (DDP's 250 MiB), so a BatchNorm model costs one collective per
    dtype. Call on all ranks, with the same buffers in the same order."""
    if world_size(group) == 1 or not buffers:
        return
    order = sorted(range(len(buffers)), key=lambda i: (str(buffers[i].dtype), str(buffers[i].device), i))
    with record_function("lightning_zero::broadcast_buffers"):
        broadcast_each([buffers[i] for i in order], 0, group, bucket_bytes=bucket_bytes)


def send(tensor: torch.Tensor, dst_rank_in_group: int, group: ProcessGroup, tag: int = 0) -> Handle:
    """Start sending ``tensor`` to group rank ``dst_rank_in_group``; keep ``tensor`` unchanged until
    the returned handle's ``wait()``. Point-to-point (pipeline stages): only the two ranks take part;
    messages between a pair with the same ``tag`` arrive in the order they were sent."""
    plain = _plain(group)
    with record_function("lightning_zero::send"):
        return Handle(dist.isend(tensor.contiguous(), dst=_global(plain, dst_rank_in_group), group=plain, tag=tag))


def recv(tensor: torch.Tensor, src_rank_in_group: int, group: ProcessGroup, tag: int = 0) -> None:
    """Receive into ``tensor`` (its shape and dtype must be the sender's) the next message with
    ``tag`` from group rank ``src_rank_in_group``; blocks until it has arrived."""
    plain = _plain(group)
    with record_function("lightning_zero::recv"):
        Handle(dist.irecv(tensor, src=_global(plain, src_rank_in_group), group=plain, tag=tag)).wait()


def new_group(ranks: list[int], timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A process group over the global ``ranks`` (default backend). Call on every rank of the default
    group, for every new group in the same order, even on ranks outside ``ranks``."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.new_group(ranks=sorted(ranks), timeout=timeout)


def all_gather_object(obj: object, group: ProcessGroup) -> list:
    """Every rank's picklable ``obj``, in rank order. Call on all ranks (slow: metadata only)."""
    if world_size(group) == 1:
        return [obj]
    out: list = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=_checked(group, "all_gather_object", ""))
    return out


def gather_object(obj: object, dst: int, group: ProcessGroup) -> list | None:
    """Every rank's picklable ``obj`` in rank order on group rank ``dst``, ``None`` on the others.
    Call on all ranks (pickled through host memory: for tensors moved to the CPU first)."""
    if world_size(group) == 1:
        return [obj]
    plain = _checked(group, "gather_object", "")
    out: list | None = [None] * world_size(group) if rank(group) == dst else None
    with record_function("lightning_zero::gather_object"):
        dist.gather_object(obj, out, dst=dist.get_global_rank(plain, dst) if plain is not None else dst, group=plain)
    return out


def barrier(group: ProcessGroup) -> None:
    """Wait until every rank of ``group`` arrives. Call on all ranks."""
    if world_size(group) == 1:
        return
    group = _checked(group, "barrier", "")
    with record_function("lightning_zero::barrier"):
        dist.barrier(group=group)


def new_gloo_group(like: ProcessGroup, timeout: timedelta | None) -> dist.ProcessGroup | None:
    """A new gloo group over the ranks of ``like`` (``None``: all ranks), for small Python objects
    next to an NCCL group. Call on every rank of the default group (even ranks not in ``like``)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    plain = _plain(like)
    ranks = None if plain is None else dist.get_process_group_ranks(plain)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


def side_gloo_group(group: ProcessGroup) -> ProcessGroup:
    """A second gloo group over the ranks of the gloo group ``group``: small exchanges on it do not
    queue behind large collectives in flight on ``group`` (gloo runs a group's work on a couple of
    threads). ``group`` itself where it is not a gloo group of several ranks. Call on every rank of
    ``group`` (only those: the ranks of other groups need not take part)."""
    if not initialized() or world_size(group) == 1 or not _is_gloo(group):
        return group
    plain = _plain(group)
    ranks = dist.get_process_group_ranks(plain if plain is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


def default_store() -> dist.Store | None:
    """The rendezvous store of the default process group, ``None`` without one. Not a collective."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    # Private, but the only handle on the store init_process_group made (torchrun: the agent's).
    return dist.distributed_c10d._get_default_store()
