"""Parameters held by several optimizers (a GAN's shared embedding in the generator's and the
discriminator's optimizer): their gradient as DDP's one ``param.grad``.

Under DDP such a parameter has one ``.grad``: every backward adds to it, any holder's
``zero_grad()`` clears it (to None), and each holder's ``step()`` reads it, or skips the parameter
while it is None; each holder keeps its own optimizer state for it. Under ZeRO the parameter has
one fp32 master slice (in a flat buffer of its own, holding only parameters with the same holders:
:func:`~lightning_zero.zero.build.build_bucketed`), and each holder's ``optimizer.state[master]``
is that holder's own state of the same slice. Its gradient, though, cannot live in the buffer's
gradient roles, which every step drops (step 3, reduce, and step 4, step, of the data path): at
each holder's step the window's reduced slice is moved into an accumulator kept here, which plays
``param.grad``:

    reduced slice --take (any holder's step)--> accumulated (master.grad at each holder's step)
    any holder's zero_grad() --> None (or zero with set_to_none=False)

"Got a gradient" is decided over all data-parallel ranks (one small all-reduce of flags per step of
an optimizer holding shared parameters): DDP's ``param.grad`` is None only where no rank produced
one, and an optimizer then skips the parameter (no weight decay, no momentum step, no state).
Memory: one slice-sized gradient per shared buffer (in the master's dtype and place), between steps.
"""

from __future__ import annotations

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.reduce import GradReducer


class SharedGrads:
    """The accumulated gradients of the flat buffers that several optimizers hold.

    Args:
        buffers: those flat buffers (each once).
        group: the data-parallel group.
    """

    def __init__(self, buffers: list[FlatBuffer], group: comm.ProcessGroup) -> None:
        self.group = group
        self.accumulated: dict[int, torch.Tensor | None] = {id(b): None for b in buffers}

    def __contains__(self, buffer: FlatBuffer) -> bool:
        return id(buffer) in self.accumulated

    def take(self, buffers: list[FlatBuffer], reducer: GradReducer, inv_scale: float) -> None:
        """Add the reduced slices of the shared ones among ``buffers`` (one optimizer's) into their
        accumulators, unscaled by ``inv_scale``, where any rank produced a gradient since the last
        take, and drop them from the buffers. After the reduction, before the step. Call on all ranks."""
        shared = [b for b in buffers if b in self]
        if not shared:
            return
        arrived = torch.tensor(
            [int(any(id(p) in reducer.got_gradient for p in b.params)) for b in shared],
            dtype=torch.int32,
            device=shared[0].device,
        )
        comm.all_reduce(arrived, self.group, label="shared parameters: got a gradient")
        for b, any_rank in zip(shared, arrived.tolist(), strict=True):
            if not any_rank:
                continue
            fresh = b.grad_for_step()
            # a copy: without a separate master the reduced slice is grad_shard itself, zeroed below
            fresh = fresh * inv_scale if inv_scale != 1.0 else fresh.clone()
            held = self.accumulated[id(b)]
            self.accumulated[id(b)] = fresh if held is None else held.add_(fresh)
        reducer.zero_grad(shared)

    def grads(self, buffers: list[FlatBuffer]) -> dict[int, torch.Tensor | None]:
        """``id(buffer) -> accumulated gradient`` (None: the optimizer skips it) of the shared ones."""
        return {id(b): self.accumulated[id(b)] for b in buffers if b in self}

    def with_grad(self, buffer: FlatBuffer) -> set[int]:
        """Ids of ``buffer``'s parameters that have a gradient (all of them while it holds one)."""
        return {id(p) for p in buffer.params} if self.accumulated[id(buffer)] is not None else set()

    def clear(self, buffers: list[FlatBuffer], set_to_none: bool) -> None:
        """A holder's ``zero_grad(set_to_none)``: every shared buffer among ``buffers`` forgets its gradient."""
        for b in buffers:
            if b not in self:
                continue
            held = self.accumulated[id(b)]
            self.accumulated[id(b)] = None if set_to_none or held is None else held.zero_()
