"""The engine's stage-3 gathers as other layers see them (a mixin of
:class:`~lightning_zero.zero.engine.ZeroEngine`): the end of a pass, the scope of a training step,
the parameters gathered around user code (:meth:`GatherSurface.gathered_parameters`), and the module
gathered last (for error messages). The hooks that gather and release during forward and backward
are :class:`~lightning_zero.zero.gather.GatherCoordinator`'s; without stage 3 there is none, and
every method here is a no-op (or, for :meth:`~GatherSurface.gathered_parameters`, scatters the
edits of persistent parameters only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.gather import GatherCoordinator
from lightning_zero.zero.swap import EngineSwap


class GatherSurface:
    """Stage 3's gathers for the layers above the engine (see the module docstring)."""

    group: comm.ProcessGroup
    swap: EngineSwap | None
    _buffers: list[FlatBuffer]
    _coordinator: GatherCoordinator | None

    def end_pass(self) -> None:
        """Stage 3: release what is still gathered; this pass's module order plans the next one."""
        if self._coordinator is not None:
            self._coordinator.end_pass()

    def last_gathered(self) -> str | None:
        """Stage 3, for error messages: the module this rank gathered last in the current (or just
        ended) pass, and how many gathers that pass made; ``None`` otherwise."""
        coordinator = self._coordinator
        trace = getattr(coordinator, "trace", None) or getattr(coordinator, "previous", None)
        names = getattr(coordinator, "names", None)
        if not trace or not names:
            return None
        return f"{names[trace[-1]]} (gather {len(trace)} of its pass)"

    def step_scope(self) -> contextlib.AbstractContextManager[None]:
        """Stage 3, around a training/validation/test/predict step: the root unit (parameters the
        root module holds itself) is gathered, and any released parameter the step reads (as a
        module attribute or through an op) is gathered on use and kept until the end of the pass.
        A no-op at stages 1 and 2. Call on all ranks."""
        return self._coordinator.step() if self._coordinator is not None else contextlib.nullcontext()

    def watch_steps(self, lockstep: Any) -> None:
        """Stage 3 under the Trainer: tell ``lockstep`` (:class:`~lightning_zero.lockstep.StepLockstep`)
        of every step and of every forward outside the steps that gathers. A no-op at stages 1 and 2."""
        if self._coordinator is not None:
            self._coordinator.lockstep = lockstep

    def step_on_root_forward(self) -> None:
        """Stage 3: the root module's forward is a step (see :meth:`step_scope`): Fabric's, where the
        loop calls the model and no step hook exists. A no-op at stages 1 and 2."""
        if self._coordinator is not None:
            self._coordinator.step_on_root_forward()

    @contextmanager
    def gathered_parameters(
        self, module: nn.Module, modifier_rank: int | None = None, *, for_backward: bool = True
    ) -> Iterator[None]:
        """Full parameters of ``module`` inside the block (stage 3; a no-op otherwise). Edits made by
        group rank ``modifier_rank`` are scattered back into every rank's shards and fp32 masters.
        With grad enabled and ``for_backward``, they stay gathered until the end of the pass (a
        backward may need them); False releases them at exit (the step follows: a buffer kept
        gathered across it would hold the weights from before the step). Call on all ranks."""
        ids = {id(p) for p in module.parameters()}
        # Whole parameters (stage 1/2, small ones under stage 3) are edited in place as well.
        persistent = [b for b in self._buffers if b.persistent and any(id(p) in ids for p in b.params)]
        sharded = self._coordinator.gathered_buffers(module) if self._coordinator is not None else []
        if self._coordinator is not None:
            self._coordinator.acquire(sharded)
        try:
            yield
            if modifier_rank is not None:
                # scatter_back writes the masters, which may be on disk (shards: through their tier)
                with self.swap.resident() if self.swap is not None else contextlib.nullcontext():
                    scatter_back(sharded + persistent, modifier_rank, self.group)
        finally:
            if self._coordinator is not None:
                if torch.is_grad_enabled() and for_backward:
                    self._coordinator.pin(sharded)
                self._coordinator.drop(sharded)


def scatter_back(buffers: list[FlatBuffer], source_rank: int | None, group: comm.ProcessGroup) -> None:
    """After user code edited gathered parameters: make every rank's shards (and fp32 masters) match
    the full parameters of ``source_rank`` (``None``: each rank keeps its own edits). Call on all ranks."""
    for b in buffers:
        assert b.flat_param is not None
        if source_rank is not None:
            comm.broadcast(b.flat_param, source_rank, group)
        start, end = b.layout.shard_range(b.rank)
        # under the parameter disk tier the shard has memory only for this write
        with b.shard_tier.rewrite([b]) if b.shard_tier is not None else contextlib.nullcontext():
            if b.param_shard.data_ptr() != b.flat_param[start:end].data_ptr():
                b.param_shard.copy_(b.flat_param[start:end])
        if b.separate_master:
            b.master.copy_(b.flat_param[start:end])
