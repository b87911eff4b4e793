"""The engine's full gradients where user code reads ``param.grad`` (a mixin of
:class:`~lightning_zero.zero.engine.ZeroEngine`): :meth:`GradientWindow.full_gradients` around
Lightning's clipping hooks and ``strategy.full_gradients``, :meth:`GradientWindow.expose_window` after
a manual backward. The gradients themselves are gathered and written back by
:class:`~lightning_zero.zero.grads.ExposedGrads`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import StrategyConfig
from lightning_zero.zero.engine_checkpoint import _unwrap
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.grads import ExposedGrads, window_slice
from lightning_zero.zero.step import ShardedOptimizer

if TYPE_CHECKING:
    from lightning_zero.zero.reduce import GradReducer
    from lightning_zero.zero.shared import SharedGrads


class GradientWindow:
    """``param.grad`` for user code (see the module docstring)."""

    config: StrategyConfig
    group: comm.ProcessGroup
    device: torch.device
    _buffers: list[FlatBuffer]
    _sharded: dict[int, ShardedOptimizer]
    _prepared: set[int]
    _reducer: GradReducer
    _shared: SharedGrads
    _exposed: ExposedGrads | None
    _window: ExposedGrads | None

    if TYPE_CHECKING:
        # The engine's optimizer step and gathers (declared for the type checker only: a stub here
        # would be found before the real method when this mixin comes first among the bases).
        def _get(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer: ...
        def _prepare(self, optimizer: torch.optim.Optimizer, inv_scale: float) -> ShardedOptimizer: ...
        def gathered_parameters(
            self, module: nn.Module, modifier_rank: int | None = None, *, for_backward: bool = True
        ) -> AbstractContextManager[None]: ...

    @contextmanager
    def full_gradients(
        self, module: nn.Module, inv_scale: float = 1.0, optimizer: torch.optim.Optimizer | None = None
    ) -> Iterator[None]:
        """Inside the block every trainable parameter of ``module`` that received a gradient in the
        current window has ``.grad``: the full reduced, unscaled gradient, as DDP's ``param.grad``
        (in the parameter's dtype; the others keep ``None``, as under DDP); under stage 3 the
        parameters are gathered too. Elementwise edits of those ``.grad`` (``clamp_``, ``mul_``, a
        replaced tensor) are written into this rank's slices at exit, so the step uses them, as under
        DDP; :meth:`grad_norm` and the clipping methods called inside see them too (and their
        clipping shows in ``.grad``). Valid where :meth:`grad_norm` is (after the window's last
        backward, until the step). Costs one all-gather of the module's gradient slices (another
        after each clipping inside) and a full-size gradient per parameter while inside
        (:mod:`lightning_zero.zero.grads`); the ``.grad`` are dropped at exit. With ``optimizer``
        only its parameters get ``.grad`` (the hooks around its step: exposing another optimizer's
        would end that one's window before its last backward). Call on all ranks."""
        ids = {id(p) for p in module.parameters()}
        if optimizer is not None:
            ids &= {id(p) for b in self._get(optimizer).buffers for p in b.params}
        buffers = [b for b in self._buffers if any(id(p) in ids for p in b.params)]
        for sharded in self._sharded.values():
            if any(b in buffers for b in sharded.buffers) and (
                optimizer is None or _unwrap(optimizer) is sharded.optimizer
            ):
                self._prepare(sharded.optimizer, inv_scale)
                sharded.materialize_grads()  # off the gradient disk tier: every slice at once, as without it
        slices = {id(b): b.master.grad for b in buffers if b.master.grad is not None}
        exposed = ExposedGrads(buffers, slices, ids & self._received(buffers), self.group, self.device)
        outer, self._exposed = self._exposed, exposed
        with self.gathered_parameters(module, for_backward=False):
            try:
                exposed.gather()
                yield
                exposed.write_back()
            finally:
                exposed.release()
                self._exposed = outer

    def expose_window(self, module: nn.Module, inv_scale: float = 1.0) -> None:
        """Manual optimization (``expose_param_grads`` not False): after a backward, the trainable
        parameters of ``module`` that received a gradient in the window get ``.grad``, the averaged,
        unscaled gradient so far (DDP's value after ``manual_backward``), until the next backward,
        step or ``zero_grad`` (:meth:`release_window`). Stages 1/2 and stage 3's whole (small)
        parameters: the full gradient (one all-gather of the slices). Stage 3's sharded parameters
        hold this rank's piece of the weight here, and get the same piece of the gradient (no
        communication; ``strategy.full_gradients`` gives whole ones). Read-only: edits are not
        applied (clip with ``self.clip_gradients``). Call on all ranks."""
        self.release_window()
        if self._prepared or not self._reducer.got_gradient:
            return  # (no gradient since the step: every .grad stays None, as DDP's after zero_grad)
        ids = {id(p) for p in module.parameters()}
        buffers = [b for b in self._buffers if any(id(p) in ids for p in b.params)]
        slices = {}
        for b in buffers:
            piece = window_slice(b, self.config.zero.stage, self.group, inv_scale)
            held = self._shared.accumulated.get(id(b))
            slices[id(b)] = piece if held is None else piece.add_(held)
        local = frozenset(id(b) for b in buffers if self.config.zero.stage == 3 and not b.persistent)
        got = ids & self._received(buffers)
        self._window = ExposedGrads(buffers, slices, got, self.group, self.device, local=local, read_only=True)
        self._window.gather()

    def _received(self, buffers: list[FlatBuffer]) -> set[int]:
        """Ids of the parameters that received a gradient in this window (those of ``buffers`` shared
        with another optimizer are taken out of the reducer's record: zero/shared.py)."""
        got = set(self._reducer.got_gradient)
        for b in buffers:
            if b in self._shared:
                got |= self._shared.with_grad(b)
        return got

    def release_window(self) -> None:
        """The ``.grad`` of :meth:`expose_window` back to None (before a backward, step or zero_grad)."""
        if self._window is not None:
            self._window.release()
            self._window = None

    def _sync_exposed(self) -> None:
        """Inside :meth:`full_gradients`: the user's edits of ``.grad`` into the slices first."""
        if self._exposed is not None:
            self._exposed.write_back()

    def _refresh_exposed(self) -> None:
        """Inside :meth:`full_gradients`, after clipping the slices: ``.grad`` shows the clipped values."""
        if self._exposed is not None:
            self._exposed.gather()
