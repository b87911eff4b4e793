"""The user's ``optimizer.step(closure)`` as the step of a ZeRO optimizer (the Trainer's path).

Under DDP, Lightning's ``LightningOptimizer.step(closure)`` calls the user's optimizer object:
its step pre-hooks, its ``step`` (a subclass's code before ``closure()``, the closure running forward,
backward and the user's ``on_before_optimizer_step`` and clipping, the code after it, the arithmetic),
then its step post-hooks. A ``Mock`` put on the instance or the class is what gets called.

ZeRO keeps that call and puts its own work inside it:

* the closure handed to the user's ``step`` runs Lightning's closure, then the engine's preparation
  (the window's reductions complete, the reduced slices become ``master.grad``), the user's hooks and
  clipping, and the overflow check;
* while the rest of the user's ``step`` runs, the optimizer's parameter groups hold this rank's fp32
  master slices (:meth:`ShardedOptimizer.masters`), so the class's own arithmetic updates the slices
  (torch's ``Adam.step`` on slices is elementwise, hence exact). Where the compiled kernels step
  (:class:`~lightning_zero.zero.step_kernels.KernelStep`) the masters' ``.grad`` are hidden from the
  class's arithmetic, which then has nothing to do, and the kernels run instead;
* the update completes (kernels, the copy into the parameters, the all-gather of the slices) in
  torch's ``_optimizer_step_code`` slot, which torch calls after the class's ``step`` and before the
  step post-hooks: post-hooks see the updated weights, as under DDP. A subclass whose ``step`` calls
  ``super().step()`` runs torch's wrapper twice; the update completes at the first (inner) one.

A ``step`` that never calls the closure (a ``Mock``, or a subclass that forgets to pass it) reduces
nothing and changes nothing, as under DDP; Lightning then raises its "closure hasn't been executed"
in automatic optimization. One that calls the closure but never reaches torch's arithmetic (a
``Mock`` with a side effect) leaves the weights unchanged and the window's gradients dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from lightning_zero.zero.reduce import GradReducer
    from lightning_zero.zero.step import ShardedOptimizer


class StepOwner(Protocol):
    """What a :class:`UserStep` calls on its engine (:class:`~lightning_zero.zero.engine.ZeroEngine`,
    which makes the step: naming its class here would tie the two modules into an import cycle)."""

    @property
    def _reducer(self) -> GradReducer: ...
    def _prepare(self, optimizer: torch.optim.Optimizer, inv_scale: float) -> ShardedOptimizer: ...
    def _update(
        self, sharded: ShardedOptimizer, *, step_kwargs: Mapping[str, Any] | None = None, stepped_by_torch: bool = False
    ) -> None: ...
    def _drop_grads(self, optimizer: torch.optim.Optimizer) -> None: ...
    def grad_norm(self, optimizer: torch.optim.Optimizer, inv_scale: float = 1.0) -> torch.Tensor: ...


class UserStep:
    """One call of the user's ``optimizer.step(closure=...)`` around ZeRO's update; see the module docstring.

    Args:
        engine: the engine that owns the optimizer's slices.
        optimizer: the user's optimizer (not a ``LightningOptimizer``).
        closure: Lightning's closure (forward, backward; returns the loss or None).
        inv_scale: the loss scale's inverse (gradients are unscaled into ``master.grad``).
        check_overflow: skip the update on non-finite gradients (see :meth:`ZeroEngine.step`).
        before_update: the user's ``on_before_optimizer_step`` hooks and clipping.
        automatic: Lightning's automatic optimization: a closure returning None skipped backward.
    """

    def __init__(
        self,
        engine: StepOwner,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        *,
        inv_scale: float,
        check_overflow: bool,
        before_update: Callable[[], None] | None,
        automatic: bool,
    ) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self.user_closure = closure
        self.inv_scale = inv_scale
        self.check_overflow = check_overflow
        self.before_update = before_update
        self.automatic = automatic
        #: the closure ran (and with it the engine's preparation)
        self.ran = False
        #: the closure ran a backward (automatic optimization: it returned a loss)
        self.update = False
        #: the update was skipped for non-finite gradients
        self.overflow = False
        #: the update was applied
        self.applied = False
        #: what the user's ``step`` returned
        self.output: Any = None
        self._armed: contextlib.ExitStack | None = None
        self._hidden: list[tuple[Any, torch.Tensor | None]] = []
        self._sharded: ShardedOptimizer | None = None
        self._whole_loaded = False

    def __call__(self, **step_kwargs: Any) -> Any:
        """Call the user's ``optimizer.step(closure=..., **step_kwargs)``; returns what it returns. Call on all ranks."""
        try:
            return self.optimizer.step(closure=self.closure, **step_kwargs)
        finally:
            self._disarm()
            if self.ran:
                self.engine._drop_grads(self.optimizer)

    def closure(self) -> Any:
        """What the user's ``step`` calls: Lightning's closure, then the engine's preparation."""
        result = self.user_closure()
        self.ran = True
        self.update = not (result is None and self.automatic)
        engine = self.engine
        sharded = engine._prepare(self.optimizer, self.inv_scale)
        if self.before_update is not None:
            self.before_update()
        if self.update:
            # (known_finite: clipped gradients on the disk tier, not read again for the check)
            self.overflow = self.check_overflow and not (
                sharded.known_finite() or bool(torch.isfinite(engine.grad_norm(self.optimizer)))
            )
            if not self.overflow:
                self._arm(sharded)
        return result

    def _arm(self, sharded: ShardedOptimizer) -> None:
        """The optimizer's groups hold the master slices until the update completes."""
        stack = contextlib.ExitStack()
        if sharded.whole is not None:
            # parameters without a gradient this window are skipped, as under DDP
            sharded.whole.got_gradient = set(self.engine._reducer.got_gradient)
            # whole-tensor groups: each owned parameter whole, with its whole gradient, for the class's
            # arithmetic; given back by the step (store) or, if the update never completes, at disarm
            sharded.whole.load()
            self._whole_loaded = True
        stack.enter_context(sharded.masters())
        if sharded.kernel is not None:
            # The kernels update these slices: the class's arithmetic finds no gradient to apply.
            self._hidden = [(b, b.master.grad) for b in sharded.buffers]
            for b in sharded.buffers:
                b.master.grad = None
        self._armed, self._sharded = stack, sharded
        # torch calls it between the class's step and the post-hooks (Optimizer.profile_hook_step)
        self.optimizer._optimizer_step_code = self._complete  # type: ignore[method-assign]  # removed in _disarm

    def _complete(self) -> None:
        if self._armed is None:
            return
        sharded = self._sharded
        assert sharded is not None
        self._whole_loaded = False  # the step stores them (ShardedOptimizer.step)
        self._disarm()
        self.engine._update(sharded, stepped_by_torch=sharded.kernel is None)
        self.applied = True

    def _disarm(self) -> None:
        self.optimizer.__dict__.pop("_optimizer_step_code", None)
        armed, self._armed = self._armed, None
        if armed is not None and self._whole_loaded and self._sharded is not None and self._sharded.whole is not None:
            # disarmed before _complete: the update never ran, the owners' whole tensors go back unused
            self._sharded.whole.release()
        self._whole_loaded = False
        for b, grad in self._hidden:
            b.master.grad = grad
        self._hidden = []
        if armed is not None:
            armed.close()
