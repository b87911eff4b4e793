"""The engine's optimizer step (a mixin of :class:`~lightning_zero.zero.engine.ZeroEngine`): step 4
of the data path as the precision plugin and the strategies drive it, and what user code may call
between the last backward of a window and the step.

Per optimizer step::

    _prepare      once per window: the reductions completed, the user's edits absorbed into the
                  masters, the reduced slices exposed as master.grad (unscaled); again is a no-op
    grad_norm, clip_grad_norm, clip_grad_value
                  on the prepared slices (global norm over every rank), valid until the step
    step          _prepare, the user's hooks and clipping (before_update), the optimizer on the slices
                  and publish (_update), the gradients dropped (_drop_grads)
    step_through  the same inside the user's own optimizer.step(closure) (the Trainer's path)
    zero_grad     the window's gradients forgotten (optimizer.zero_grad() is routed here)

The sharded optimizers (:class:`~lightning_zero.zero.step.ShardedOptimizer`, or
:class:`~lightning_zero.zero.replicated.ReplicatedOptimizer` for a whole-model one) do the
arithmetic; this mixin decides when.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero import comm
from lightning_zero.config import StrategyConfig
from lightning_zero.zero.engine_checkpoint import _unwrap
from lightning_zero.zero.flat_grads import GradState
from lightning_zero.zero.grads import ExposedGrads
from lightning_zero.zero.publish import Publisher, publish
from lightning_zero.zero.reduce import BACKWARD_OUTSIDE, GradReducer
from lightning_zero.zero.replicated import ReplicatedCall, ReplicatedOptimizer
from lightning_zero.zero.shared import SharedGrads
from lightning_zero.zero.step import ShardedOptimizer
from lightning_zero.zero.swap import EngineSwap
from lightning_zero.zero.user_step import UserStep


class OptimizerSteps:
    """The optimizer step of the engine (see the module docstring)."""

    config: StrategyConfig
    group: comm.ProcessGroup
    device: torch.device
    swap: EngineSwap | None
    _optimizers: list[torch.optim.Optimizer]
    _sharded: dict[int, ShardedOptimizer]
    _reducer: GradReducer
    _shared: SharedGrads
    _norms: dict[int, torch.Tensor]
    _exposed: ExposedGrads | None
    _prepared: set[int]
    _routed: list[torch.optim.Optimizer]

    if TYPE_CHECKING:
        # The engine's and its gradient window's (declared for the type checker only: a stub here
        # would be found before the real method when this mixin comes first among the bases).
        def add_param_groups(self) -> None: ...
        def release_window(self) -> None: ...
        def _sync_exposed(self) -> None: ...
        def _refresh_exposed(self) -> None: ...

    def manages(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` (or the one a ``LightningOptimizer`` wraps) steps ZeRO slices."""
        return id(_unwrap(optimizer)) in self._sharded

    def replicates(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is a whole-model one (LBFGS): its own ``step`` runs the closure (:meth:`step_through`)."""
        return isinstance(self._get(optimizer), ReplicatedOptimizer)

    def _get(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        return self._sharded[id(_unwrap(optimizer))]

    def optimizer_index(self, optimizer: torch.optim.Optimizer) -> int | None:
        """Position of ``optimizer`` in the list the engine was built with (the indices of
        :attr:`HeldParam.optimizers`), ``None`` for one the engine does not manage."""
        target = _unwrap(optimizer)
        return next((i for i, o in enumerate(self._optimizers) if o is target), None)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        inv_scale: float = 1.0,
        check_overflow: bool = False,
        before_update: Callable[[], None] | None = None,
        update: bool = True,
        step_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """One optimizer step on this rank's slices. Call on all ranks.

        The reduced gradient slices become ``master.grad``, multiplied by ``inv_scale``;
        ``before_update`` then runs (the user's hooks, clipping: :meth:`grad_norm` and
        :meth:`clip_grad_norm` are valid there). Unless ``update`` is False (no backward ran), the
        optimizer steps the slices and they are published; with ``check_overflow`` a non-finite
        global norm skips that (one scalar all-reduce and one host sync, before anything is
        written, so a bad batch never reaches the weights). The gradients are dropped either way.
        Returns True when the update was skipped for non-finite gradients. ``step_kwargs`` go to the
        optimizer's own ``step`` (see :meth:`ShardedOptimizer.step`).
        """
        sharded = self._prepare(optimizer, inv_scale)
        if before_update is not None:
            before_update()
        overflow = False
        sharded.note_gradients(set(self._reducer.got_gradient))  # the others are skipped, as under DDP
        if update:
            # (known_finite: clipped gradients on the disk tier, not read again for the check)
            overflow = check_overflow and not (
                sharded.known_finite() or bool(torch.isfinite(self.grad_norm(optimizer)))
            )
            if not overflow:
                self._update(sharded, step_kwargs=step_kwargs)
        self._drop_grads(optimizer)  # (a shared parameter's accumulated gradient stays: zero_grad clears it)
        return overflow

    def step_through(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        *,
        inv_scale: float = 1.0,
        check_overflow: bool = False,
        before_update: Callable[[], None] | None = None,
        automatic: bool = True,
        step_kwargs: Mapping[str, Any] | None = None,
    ) -> UserStep | ReplicatedCall:
        """The step as the user's own ``optimizer.step(closure=..., **step_kwargs)`` (the Trainer's
        path, :mod:`lightning_zero.zero.user_step`): the closure handed to it runs ``closure``, the
        preparation of :meth:`step` and ``before_update``; the class's step then updates the master
        slices (or the kernels do) and they are published (a whole-model optimizer: :mod:`~lightning_zero.zero.replicated`).
        Returns the record of what happened (``output``: what the user's ``step`` returned). Call on all ranks."""
        kind = ReplicatedCall if self.replicates(optimizer) else UserStep
        call = kind(
            self,
            _unwrap(optimizer),
            closure,
            inv_scale=inv_scale,
            check_overflow=check_overflow,
            before_update=before_update,
            automatic=automatic,
        )
        call.output = call(**(step_kwargs or {}))
        return call

    def _update(
        self, sharded: ShardedOptimizer, *, step_kwargs: Mapping[str, Any] | None = None, stepped_by_torch: bool = False
    ) -> None:
        """Update the master slices of a prepared optimizer and publish them (``stepped_by_torch``:
        the class's own step already updated them; only the copy and the publication are left)."""
        if self.config.offload.pipeline and sharded.pipelines:
            # each buffer's all-gather starts as soon as it is stepped (zero/publish.py)
            publisher = Publisher(self.group, self.config.zero.allgather_bucket_size)
            sharded.step(publisher.send, step_kwargs)
            publisher.finish(sharded.buffers)
        else:
            sharded.step(step_kwargs=step_kwargs, stepped_by_torch=stepped_by_torch)
            if not isinstance(sharded, ReplicatedOptimizer):  # (replicated: every rank holds the update)
                publish(sharded.buffers, self.group, self.config.zero.allgather_bucket_size)

    def _prepare(self, optimizer: torch.optim.Optimizer, inv_scale: float) -> ShardedOptimizer:
        """Once per optimizer step: finish the window's reductions and expose the reduced, unscaled
        slices as ``master.grad``. A second call before the step (or :meth:`zero_grad`) is a no-op,
        so clipping or a norm asked for before ``optimizer.step()`` (manual optimization) sees the
        gradients the step will use, as under DDP. Call on all ranks."""
        self.add_param_groups()
        sharded = self._get(optimizer)
        key = id(sharded.optimizer)
        self.release_window()
        if key not in self._prepared:
            if self._reducer.unfinished():
                raise RuntimeError(
                    f"gradients of an unfinished backward reached the optimizer step: {BACKWARD_OUTSIDE}."
                )
            # The user's in-place edits since the last step reach the master (not under the disk
            # tier: its masters are on disk between steps; a checkpoint still absorbs them).
            if self.config.zero.absorb_param_edits and self.swap is None:
                for buffer in sharded.buffers:
                    buffer.absorb_edits()
            self._norms.pop(key, None)
            self._reducer.reduce_for_step(sharded.buffers)
            self._reducer.wait_host_copies()
            self._reducer.add_tied(sharded.buffers)
            self._shared.take(sharded.buffers, self._reducer, inv_scale)
            sharded.prepare(inv_scale, given=self._shared.grads(sharded.buffers))
            self._prepared.add(key)
        return sharded

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Forget every gradient of ``optimizer``'s slices since its last step: what
        ``optimizer.zero_grad()`` means (routed here, see :meth:`_route_zero_grad`), at any point;
        also the accumulated gradient of parameters it shares with other optimizers, as DDP's
        ``zero_grad`` clears their one ``param.grad``."""
        self.release_window()
        self._drop_grads(optimizer)
        self._shared.clear(self._get(optimizer).buffers, set_to_none)

    def _drop_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients held in ``optimizer``'s flat buffers back to zero (after its step)."""
        sharded = self._get(optimizer)
        key = id(sharded.optimizer)
        self._reducer.wait_host_copies()  # an offloaded copy in flight must not land after the drop
        sharded.release_grads()
        if key in self._prepared or any(b.grad_state is not GradState.EMPTY for b in sharded.buffers):
            self._reducer.zero_grad(sharded.buffers)
        self._prepared.discard(key)
        self._norms.pop(key, None)

    def _route_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.zero_grad()`` clears the master slices' ``.grad`` only; ZeRO also holds the
        window's gradients in its flat buffers, so the call is extended to drop those (manual
        optimization calls it anywhere, e.g. between two backwards). Undone by :meth:`close`."""
        original = optimizer.zero_grad

        optimizer.zero_grad = functools.partial(_routed_zero_grad, self, optimizer, original)  # type: ignore[method-assign]  # an instance attribute, removed at close
        self._routed.append(optimizer)

    def grad_norm(self, optimizer: torch.optim.Optimizer, inv_scale: float = 1.0) -> torch.Tensor:
        """Global gradient L2 norm over all ranks (fp32 scalar), valid from the last backward of a
        window until the step. Call on all ranks."""
        sharded = self._prepare(optimizer, inv_scale)
        key = id(sharded.optimizer)
        if self._exposed is not None:
            self._sync_exposed()
            self._norms.pop(key, None)  # .grad may have been edited since
        if key not in self._norms:
            self._norms[key] = sharded.grad_norm()
        return self._norms[key]

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float, inv_scale: float = 1.0) -> torch.Tensor:
        """Clip to a global norm of ``max_norm``; returns the norm before clipping. Call on all ranks."""
        # No isfinite() check here: it would synchronize the host. A non-finite norm makes the
        # coefficient 0 or NaN, and "16-mixed" skips such a step anyway (as torch's clip_grad_norm_).
        norm = self.grad_norm(optimizer, inv_scale)
        self._get(optimizer).clip_grad_norm(max_norm, norm)
        self._norms.pop(id(_unwrap(optimizer)), None)  # clipped: the next norm is another one
        self._refresh_exposed()
        return norm

    def clip_grad_value(self, optimizer: torch.optim.Optimizer, clip_value: float, inv_scale: float = 1.0) -> None:
        """Clamp every gradient element of this rank's slices to ``[-clip_value, clip_value]``."""
        sharded = self._prepare(optimizer, inv_scale)
        self._sync_exposed()
        sharded.clip_grad_value(clip_value)
        self._norms.pop(id(_unwrap(optimizer)), None)
        self._refresh_exposed()


def _routed_zero_grad(
    engine: OptimizerSteps, optimizer: torch.optim.Optimizer, original: Callable[[bool], None], set_to_none: bool = True
) -> None:
    """``optimizer.zero_grad()`` under ZeRO (:meth:`OptimizerSteps._route_zero_grad`); a module-level
    function, so that an optimizer (and a trainer holding it) still pickles."""
    engine.release_window()  # the exposed .grad go first: the class's zero_grad must not clear them
    original(set_to_none)
    engine.zero_grad(optimizer, set_to_none)
