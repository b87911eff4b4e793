"""Step 3 of the data path, **reduce**: gradients from autograd into each rank's averaged slice.

A post-accumulate-grad hook on every partitioned parameter adds the new gradient into its flat
buffer's ``grad_bucket`` and frees ``param.grad`` at once (the gradient exists whole only until it
is copied). When every parameter of a bucket has reported, the bucket is reduce-scattered
asynchronously, so the collective overlaps the rest of backward. Buckets are launched strictly in
bucket order, on every rank: ranks whose gradients arrive in a different order, or not at all
(unused parameters), still issue the same collectives in the same order, so nothing can hang.
After backward, :meth:`GradReducer.finish` launches what is left (missing gradients count as zero),
waits, and divides by the world size.

Stage 1 keeps full gradients: its buckets persist and accumulate over micro-steps, and are reduced
only on the backward of the accumulation boundary. Stage 2 reduces on every backward into
``grad_shard`` (accumulating across micro-steps there) and frees the bucket right away.

Both stages reduce-scatter rather than all-reduce: the optimizer step needs only this rank's slice,
and reduce-scatter moves half the bytes of an all-reduce.

On a GPU the copies and collectives run on a side stream; see :class:`SideStream` for the events.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, Optional

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer


class SideStream:
    """A CUDA stream for gradient copies and reductions; a no-op on other devices.

    ``enter()`` makes the side stream wait for the current (compute) stream, so the gradient that
    autograd just produced is complete before it is copied; ``join()`` makes the compute stream wait
    for the side stream, so the optimizer never reads a slice still being reduced. Neither blocks
    the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that ``tensor`` is used on the side stream."""
        if self.stream is not None:
            tensor.record_stream(self.stream)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class GradReducer:
    """Owns the gradient hooks and buckets of a list of flat buffers (all optimizers of a model)."""

    def __init__(
        self,
        buffers: list[FlatBuffer],
        stage: int,
        group: comm.ProcessGroup,
        device: torch.device,
        overlap_comm: bool = True,
    ) -> None:
        self.buffers = buffers
        self.stage = stage
        self.group = group
        self.world_size = comm.world_size(group)
        self.overlap_comm = overlap_comm
        self.side = SideStream(device)
        #: False inside :meth:`no_sync` (stage 1 accumulates locally there).
        self.sync = True
        self._next_launch = 0
        self._pending: list[tuple[FlatBuffer, comm.Handle, Optional[torch.Tensor]]] = []
        self._handles = []
        for b_index, buffer in enumerate(buffers):
            for p_index, param in enumerate(buffer.params):
                hook = partial(self._on_grad, b_index, p_index)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    # -- called by autograd -------------------------------------------------------------------

    def _on_grad(self, b_index: int, p_index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        buffer = self.buffers[b_index]
        if b_index < self._next_launch:
            raise RuntimeError(
                f"a gradient for parameter {p_index} of bucket {b_index} (shape {tuple(param.shape)}) arrived after "
                "its bucket was reduced in this backward. This happens when a parameter gets gradients from "
                "two separate backward passes inside one backward call (e.g. reentrant checkpointing); use "
                "torch.utils.checkpoint with use_reentrant=False."
            )
        if grad.is_sparse:
            raise ValueError(f"sparse gradients are not supported under ZeRO (parameter shape {tuple(param.shape)}).")
        slot = buffer.layout.slots[p_index]
        with self.side.enter():
            buffer.bucket()[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1))
            self.side.keep_alive(grad)
        param.grad = None
        buffer.arrived.add(p_index)
        if buffer.complete:
            buffer.release()  # stage 3: its parameters are not needed again in this backward
        if self._reducing and self.overlap_comm:
            self._launch(only_complete=True)

    # -- the reduction ------------------------------------------------------------------------

    @property
    def _reducing(self) -> bool:
        return self.stage >= 2 or self.sync

    def _launch(self, only_complete: bool) -> None:
        """Launch buckets in order, from the first not yet launched; stop at an incomplete one
        unless ``only_complete`` is False (end of backward: missing gradients are zero)."""
        while self._next_launch < len(self.buffers):
            buffer = self.buffers[self._next_launch]
            if only_complete and not buffer.complete:
                return
            with self.side.enter():
                bucket = buffer.bucket()
                if self.stage == 1 or buffer.grad_shard_fresh:
                    out, extra = buffer.grad_shard, None
                else:
                    out = extra = torch.empty_like(buffer.grad_shard)
                handle = comm.reduce_scatter(out, bucket, self.group, async_op=True)
            self._pending.append((buffer, handle, extra))
            self._next_launch += 1

    def finish(self) -> None:
        """End of one backward: complete every reduction of it. Call on all ranks after each backward."""
        if self._reducing:
            self._launch(only_complete=False)
            with self.side.enter():
                for buffer, handle, extra in self._pending:
                    handle.wait()
                    # Average after the sum (one pass over the slice, not the whole bucket); stage 1
                    # may reduce the same accumulated bucket again, so the bucket stays unscaled.
                    if extra is None:
                        buffer.grad_shard.div_(self.world_size)
                    else:
                        buffer.grad_shard.add_(extra.div_(self.world_size))
                    buffer.grad_shard_fresh = False
                    if self.stage >= 2:
                        buffer.grad_bucket = None
            self.side.join()
        self._pending.clear()
        self._next_launch = 0
        for buffer in self.buffers:
            buffer.arrived.clear()

    def zero_grad(self, buffers: list[FlatBuffer]) -> None:
        """Forget the gradients of ``buffers`` after their optimizer stepped."""
        for buffer in buffers:
            buffer.grad_shard.zero_()
            buffer.grad_shard_fresh = True
            if buffer.grad_bucket is not None:
                buffer.grad_bucket.zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before the accumulation boundary (stage 1 skips communication there)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
