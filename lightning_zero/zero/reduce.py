"""Step 3 of the data path, **reduce**: gradients from autograd into each rank's averaged slice.

A post-accumulate-grad hook on every partitioned parameter adds the new gradient into its flat
buffer's ``grad_bucket`` and frees ``param.grad`` at once (the gradient exists whole only until it
is copied).

Stage 1 keeps full gradients: every buffer has a persistent bucket that accumulates over all
micro-steps and backward calls, and is reduced once, at the accumulation boundary (the optimizer
step, :meth:`GradReducer.reduce_for_step`), in place: ``grad_shard`` is a view of the bucket's
slice r, so stage 1 holds exactly the 2 bytes of full gradients per parameter of the ZeRO formula.

Stages 2 and 3 reduce on every backward. When every parameter of a bucket has reported, the
bucket is reduce-scattered asynchronously, so the collective overlaps the rest of backward, and the
bucket goes back to the engine's :class:`~lightning_zero.zero.pools.BlockPool` as soon as its reduction is done (a completed one is noticed at
the next gradient). Buckets are launched strictly in bucket order, on every rank: ranks whose
gradients arrive in a different order, or not at all (unused parameters), still issue the same
collectives in the same order, so nothing can hang. After backward, :meth:`GradReducer.finish`
launches what is left (missing gradients count as zero), waits, and averages into ``grad_shard``,
which accumulates across micro-steps.

Reduce-scatter, not all-reduce, is the operation: the step needs only this rank's slice. (On gloo
:func:`lightning_zero.comm.reduce_scatter` runs it as an in-place all-reduce, which is faster there.)
On a GPU the copies and collectives run on a side stream; see :class:`SideStream` for the events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.pools import BlockPool
from lightning_zero.zero.surface import TiedAcrossStages

BACKWARD_OUTSIDE = (
    "a backward called as loss.backward() or torch.autograd.backward() instead of self.manual_backward(loss) "
    "in manual optimization, or fabric.backward(loss) under Fabric: ZeRO completes its gradient reductions "
    "there; call that instead"
)


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

    def record(self) -> torch.cuda.Event | None:
        """An event after everything queued on the side stream (None off CUDA): the host waits on it
        only when it needs the device-to-host gradient copies (the offloaded step)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class GradReducer:
    """Owns the gradient hooks, the bucket pool and the schedule of reductions of a list of flat
    buffers (all optimizers of a model). What each buffer's gradients hold is the buffer's own
    :class:`~lightning_zero.zero.flat_grads.GradState`; the reducer only decides when it changes."""

    def __init__(
        self,
        buffers: list[FlatBuffer],
        *,
        stage: int,
        group: comm.ProcessGroup,
        device: torch.device,
        overlap_comm: bool = True,
        tied: Sequence[TiedAcrossStages] = (),
        pool: BlockPool | None = None,
    ) -> None:
        self.buffers = list(buffers)  # its own list: add_buffers extends it
        self.stage = stage
        self.group = group
        self.world_size = comm.world_size(group)
        self.overlap_comm = overlap_comm
        self.side = SideStream(device)
        self.pool = pool if pool is not None else BlockPool()
        self.host_copies_done: torch.cuda.Event | None = None
        self._next_launch = 0
        self._pending: list[tuple[FlatBuffer, comm.Handle, torch.Tensor]] = []  # (buffer, reduction, its output)
        self._handles = []
        #: ids of the parameters that received a gradient since their optimizer's last zero_grad
        #: (DDP leaves ``param.grad`` None for the others: :meth:`ZeroEngine.full_gradients` too)
        self.got_gradient: set[int] = set()
        # Pipeline parallelism: parameters tied across stages, id -> (accumulator, buffer, slot index, group)
        self._tied: dict[int, tuple[torch.Tensor, FlatBuffer, int, comm.ProcessGroup]] = {}
        for b_index, buffer in enumerate(buffers):
            if stage == 1:
                buffer.keep_bucket()
            for p_index, param in enumerate(buffer.params):
                hook = partial(self._on_grad, b_index, p_index)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))
        for t in tied:
            self._tie(t.param, t.group)

    def add_buffers(self, buffers: list[FlatBuffer]) -> None:
        """Reduce ``buffers`` too from now on (parameter groups added during fit; stages 1/2): their
        hooks, their place at the end of the launch order (the same on every rank). A gradient
        autograd already left in ``param.grad`` (a backward before they were added) is taken into
        the bucket and, at stage 2, reduced at once. Call on all ranks."""
        start = len(self.buffers)
        self.buffers.extend(buffers)
        for b_index, buffer in enumerate(buffers, start):
            if self.stage == 1:
                buffer.keep_bucket()
            for p_index, param in enumerate(buffer.params):
                self._handles.append(param.register_post_accumulate_grad_hook(partial(self._on_grad, b_index, p_index)))
                if param.grad is not None:
                    self.got_gradient.add(id(param))
                    buffer.receive(p_index, param.grad, partial(self._new_bucket, buffer))
                    param.grad = None
        if self.stage >= 2:
            for buffer in buffers:
                bucket, out = buffer.start_reduce(partial(self._new_bucket, buffer))
                comm.reduce_scatter(out, bucket, self.group, clobber_input=True)
                returned = buffer.finish_reduce(out, self.world_size, to_host=True)
                if returned is not None:
                    self.pool.give(returned)
        for buffer in buffers:
            buffer.end_backward()

    # -- called by autograd -------------------------------------------------------------------

    def _on_grad(self, b_index: int, p_index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        buffer = self.buffers[b_index]
        if self.stage >= 2 and b_index < self._next_launch:
            raise RuntimeError(
                f"a gradient for parameter {p_index} of bucket {b_index} (shape {tuple(param.shape)}) arrived after "
                "its bucket was reduced. Either the previous backward was not finished by the strategy "
                f"({BACKWARD_OUTSIDE}), or a parameter got gradients from two separate backward passes inside one "
                "backward call (reentrant checkpointing: use torch.utils.checkpoint with use_reentrant=False)."
            )
        if grad.is_sparse:
            # nn.Embedding(sparse=True): reduced as the dense gradient it stands for (DDP's sparse
            # all-reduce sums to the same values); the flat buckets hold every element anyway.
            grad = grad.to_dense()
        self.got_gradient.add(id(param))
        tied = self._tied.get(id(param))
        with self.side.enter():
            if tied is not None:  # summed over its stages at the step (add_tied), not bucketed
                tied[0].add_(grad.reshape(-1))
                buffer.arrive(p_index)
            else:
                if buffer.grad_bucket is None:
                    self._make_room()  # also when autograd's gradient becomes the bucket (FlatBuffer.adopts)
                buffer.receive(p_index, grad, partial(self._new_bucket, buffer))
            self.side.keep_alive(grad)
        param.grad = None
        if buffer.complete:
            buffer.release()  # stage 3: its parameters are not needed again in this backward
        if self.stage >= 2 and self.overlap_comm:
            self._launch(only_complete=True)
            self._drain(block=False)

    #: stages 2/3: most buckets alive at once (one collecting, one reducing: double buffering, as
    #: DeepSpeed's ``ipg`` buffers); a further one waits for the oldest reduction to finish first.
    #: Without the bound, reductions slower than backward (gloo) pile up: measured 6 buckets = 75% of
    #: a 34M-parameter model's gradients alive at once at stage 2.
    MAX_BUCKETS = 2

    def _make_room(self) -> None:
        """Stages 2/3: before a further bucket comes alive, wait for the oldest reductions until fewer
        than :attr:`MAX_BUCKETS` are."""
        if self.stage >= 2:
            while self._pending and self._buckets_alive() >= self.MAX_BUCKETS:
                self._drain(block=True, limit=1)

    def _new_bucket(self, buffer: FlatBuffer) -> torch.Tensor:
        self._make_room()
        return self.pool.take(buffer.layout.padded_numel, buffer.grad_dtype, buffer.device, zero=True)

    def _buckets_alive(self) -> int:
        return sum(1 for b in self.buffers if b.grad_bucket is not None)

    # -- stages 2 and 3: reduce every backward -----------------------------------------------------

    def _launch(self, only_complete: bool) -> None:
        """Launch buckets in order, from the first not yet launched; stop at an incomplete one
        unless ``only_complete`` is False (end of backward: missing gradients are zero)."""
        while self._next_launch < len(self.buffers):
            buffer = self.buffers[self._next_launch]
            if only_complete and not buffer.complete:
                return
            with self.side.enter():
                bucket, out = buffer.start_reduce(partial(self._new_bucket, buffer))
                handle = comm.reduce_scatter(out, bucket, self.group, async_op=True, clobber_input=True)
            self._pending.append((buffer, handle, out))
            self._next_launch += 1

    def _drain(self, block: bool, limit: int | None = None) -> None:
        """Finish reductions from the oldest on: average into ``grad_shard`` (ZeRO-Offload: start
        moving the slice to the host now, overlapping the rest of backward), recycle the bucket.
        Without ``block`` stop at the first one still running; stop after ``limit`` of them."""
        with self.side.enter():
            while self._pending and (limit is None or limit > 0):
                limit = None if limit is None else limit - 1
                buffer, handle, out = self._pending[0]
                if not block and not handle.is_completed():
                    break
                handle.wait()
                self._pending.pop(0)
                bucket = buffer.finish_reduce(out, self.world_size, to_host=True)
                if bucket is not None:
                    self.pool.give(bucket)

    def finish(self) -> None:
        """End of one backward: complete every reduction of it. Call on all ranks after each backward."""
        if self.stage >= 2:
            self._launch(only_complete=False)
            self._drain(block=True)
            self.side.join()
            self.host_copies_done = self.side.record()
        self._next_launch = 0
        for buffer in self.buffers:
            buffer.end_backward()

    # -- stage 1: reduce at the accumulation boundary ----------------------------------------------

    def reduce_for_step(self, buffers: list[FlatBuffer]) -> None:
        """Stage 1: reduce the accumulated buckets of ``buffers`` in place. Call on all ranks before the step."""
        if self.stage != 1:
            return
        with self.side.enter():
            outs, handles = [], []
            for b in buffers:
                bucket, out = b.start_reduce(partial(self._new_bucket, b))  # in place: out is grad_shard
                outs.append(out)
                handles.append(comm.reduce_scatter(out, bucket, self.group, async_op=True, clobber_input=True))
            for b, out, handle in zip(buffers, outs, handles, strict=True):
                handle.wait()
                # No host copy here: the offloaded step reads grad_shard right after, at the step.
                b.finish_reduce(out, self.world_size, to_host=False)
        self.side.join()

    # -- pipeline parallelism: parameters tied across stages ---------------------------------------

    def _tie(self, param: torch.Tensor, group: comm.ProcessGroup) -> None:
        """Sum ``param``'s gradient over ``group`` (the same rank of every pipeline stage holding a copy
        of it) before the data-parallel average, so that every copy takes the same step. Its
        gradients accumulate whole, outside the buckets, until :meth:`add_tied`."""
        for buffer in self.buffers:
            for p_index, p in enumerate(buffer.params):
                if p is param:
                    accum = torch.zeros(param.numel(), dtype=buffer.grad_dtype, device=buffer.device)
                    self._tied[id(param)] = (accum, buffer, p_index, group)
                    return
        raise ValueError(f"tied parameter of shape {tuple(param.shape)} is in no optimizer; ZeRO cannot reduce it")

    def add_tied(self, buffers: list[FlatBuffer]) -> None:
        """Sum each tied gradient over its stages and average it over the data-parallel group into this
        rank's slice. Call on all ranks at the step, after :meth:`reduce_for_step` (the same tied
        parameters, in the same order, on every stage that holds them)."""
        ids = {id(b) for b in buffers}
        for accum, buffer, p_index, group in self._tied.values():
            if id(buffer) not in ids:
                continue
            comm.all_reduce(accum, group, label="tied parameter")
            comm.all_reduce(accum, self.group, label="tied parameter")
            accum.div_(self.world_size)
            slot = buffer.layout.slots[p_index]
            start, end = buffer.layout.shard_range(buffer.rank)
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                buffer.add_to_grads(lo - start, accum[lo - slot.offset : hi - slot.offset])
            accum.zero_()

    # -- checkpoints in the middle of an accumulation window -------------------------------------

    def _signature(self) -> list[tuple[int, int, int, int, int | None]]:
        return [
            (b.layout.padded_numel, b.layout.world_size, b.rank, len(b.params), b.optimizer_group) for b in self.buffers
        ]

    def window_state(self) -> dict[str, Any] | None:
        """The gradients accumulated since the last optimizer step, as host copies: each buffer's
        (:meth:`FlatBuffer.window_grads`), the tied accumulators, and which parameters got a gradient;
        with the layout they belong to. ``None`` at a window boundary (no gradient since the step).
        Local: every rank saves its own."""
        if not self.got_gradient:
            return None
        if self.unfinished():
            raise RuntimeError(f"a checkpoint was saved in the middle of a backward: {BACKWARD_OUTSIDE}.")
        got = [
            (b, p)
            for b, buffer in enumerate(self.buffers)
            for p, param in enumerate(buffer.params)
            if id(param) in self.got_gradient
        ]
        return {
            "stage": self.stage,
            "buffers": self._signature(),
            "grads": [b.window_grads() for b in self.buffers],
            "tied": [accum.detach().to("cpu", copy=True) for accum, _, _, _ in self._tied.values()],
            "got_gradient": got,
        }

    def load_window_state(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`window_state` saved, so the window goes on as if never interrupted:
        only into the same stage and flat-buffer layout (``ValueError`` otherwise). Local."""
        layout = [tuple(b) for b in state["buffers"]]
        if state["stage"] != self.stage or layout != self._signature() or len(state["tied"]) != len(self._tied):
            raise ValueError(
                f"the checkpoint was saved in the middle of a gradient-accumulation window, at ZeRO stage {state['stage']} "
                f"with {len(layout)} flat buffers on data-parallel rank {layout[0][2] if layout else '?'} of "
                f"{layout[0][1] if layout else '?'}; its partial gradients fit only that layout (here: stage {self.stage}, "
                f"{len(self.buffers)} flat buffers, rank {self.buffers[0].rank if self.buffers else '?'} of "
                f"{self.world_size}). Resume with the same world size, stage and bucket sizes, or from a checkpoint "
                "saved at a window boundary (ModelCheckpoint(every_n_train_steps=...) saves there)."
            )
        for buffer, saved in zip(self.buffers, state["grads"], strict=True):
            if saved is not None:
                buffer.load_window_grads(*saved)
        for (accum, _, _, _), saved in zip(self._tied.values(), state["tied"], strict=True):
            accum.copy_(saved)
        self.got_gradient.update(id(self.buffers[b].params[p]) for b, p in state["got_gradient"])

    def unfinished(self) -> bool:
        """A backward brought gradients that :meth:`finish` has not completed (it was not called)."""
        return self._next_launch > 0 or bool(self._pending) or any(b.arrived for b in self.buffers)

    def zero_grad(self, buffers: list[FlatBuffer]) -> None:
        """Forget the gradients of ``buffers`` after their optimizer stepped."""
        for buffer in buffers:
            buffer.drop_grads()
            self.got_gradient.difference_update(id(p) for p in buffer.params)

    def wait_host_copies(self) -> None:
        """Block the host until the offloaded gradient slices have reached host memory."""
        if self.host_copies_done is not None:
            self.host_copies_done.synchronize()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
