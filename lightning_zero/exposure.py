"""Where Lightning code reads ``param.grad`` under automatic optimization, and what ZeRO gives it.

Under ZeRO a gradient never stays in ``param.grad`` (:mod:`lightning_zero.zero.grads`). DDP users read
it in three places of an automatic run; ``ZeroStrategy(expose_param_grads=None)``, the default, gives
it there as DDP does where user code can read it, and costs nothing where none does:

* ``on_before_optimizer_step`` and ``configure_gradient_clipping``: full gradients (edits such as
  ``p.grad.clamp_`` or ``clip_grad_norm_`` reach the step) when the LightningModule overrides either
  hook or a callback overrides ``on_before_optimizer_step`` (:func:`reads_step_grads`);
* a validation run inside a gradient-accumulation window (``val_check_interval`` not a multiple of
  ``accumulate_grad_batches``): the window's averaged gradients so far, read-only, from
  ``on_validation_start`` until the next backward (:class:`ValidationWindow`).

``expose_param_grads=False`` turns both off; a hook that would then read ``None`` is named in a
warning at setup (:func:`warn_unexposed`), so that a clipping call finding no gradient never passes
silently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from lightning_zero.zero import ZeroEngine


class LossScaled(Protocol):
    """What this module reads of the precision plugin (:class:`~lightning_zero.precision.OffloadPrecision`,
    which imports this module: naming its class here would tie the two into a cycle)."""

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        ...


def reads_step_grads(model: pl.LightningModule) -> bool:
    """Whether user code runs where DDP's ``param.grad`` is readable around an automatic step: the
    model's ``on_before_optimizer_step`` or ``configure_gradient_clipping``, or a callback's
    ``on_before_optimizer_step`` (Lightning's own callbacks define none)."""
    if is_overridden("on_before_optimizer_step", model, pl.LightningModule):
        return True
    if is_overridden("configure_gradient_clipping", model, pl.LightningModule):
        return True
    callbacks: list[pl.Callback] = getattr(model._trainer, "callbacks", [])
    return any(is_overridden("on_before_optimizer_step", c, pl.Callback) for c in callbacks)


def install(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    engine: ZeroEngine | None,
    precision: LossScaled,
    pipelined: bool = False,
) -> None:
    """At setup (fitting): the :class:`ValidationWindow` callback first among the trainer's, or with
    ``expose_param_grads=False`` the warning of :func:`warn_unexposed`. (Under a pipeline schedule
    every backward runs inside ``training_step``: no window is exposed there.)"""
    if engine is None:
        return
    exposed = engine.config.zero.expose_param_grads
    if exposed is False:
        warn_unexposed(model)
    elif exposed is None and model.automatic_optimization and reads_step_grads(model):
        rank_zero_info(
            "ZeRO: on_before_optimizer_step / configure_gradient_clipping are overridden, so param.grad holds "
            "the full reduced gradients there, as under DDP: one all-gather of the gradients per optimizer step "
            "and their full size in memory while the hooks run. ZeroStrategy(expose_param_grads=False) avoids "
            "that when those hooks do not read param.grad."
        )
    elif not pipelined:
        callbacks: list[pl.Callback] = getattr(trainer, "callbacks")  # noqa: B009 - a property mypy cannot see
        callbacks.insert(0, ValidationWindow(engine, precision))


def uninstall(trainer: pl.Trainer | None) -> None:
    """At teardown: the callback of :func:`install` holds the engine, so it is not kept past fit."""
    if trainer is not None:
        callbacks: list[pl.Callback] = getattr(trainer, "callbacks")  # noqa: B009 - a property mypy cannot see
        callbacks[:] = [c for c in callbacks if not isinstance(c, ValidationWindow)]


def warn_unexposed(model: pl.LightningModule) -> None:
    """``expose_param_grads=False`` with a hook that reads gradients: say that they are None there."""
    if not model.automatic_optimization or not reads_step_grads(model):
        return
    rank_zero_warn(
        "ZeroStrategy(expose_param_grads=False): param.grad is None in on_before_optimizer_step and "
        "configure_gradient_clipping, which this run overrides, so code there that reads or clips param.grad "
        "(torch.nn.utils.clip_grad_norm_, p.grad.clamp_) finds no gradient and does nothing. Clip with "
        "self.clip_gradients(...) or Trainer(gradient_clip_val=...) (they clip ZeRO's slices), read the norm "
        "with trainer.strategy.grad_norm(optimizer), or leave expose_param_grads at None."
    )


class ValidationWindow(pl.Callback):
    """Gives ``param.grad`` (the window's averaged, unscaled gradients so far, read-only) to the
    validation hooks of a run that validates inside an accumulation window, as DDP leaves them there.
    Installed first among the trainer's callbacks by the strategy, so that every
    ``on_validation_start`` sees them; they go at the next backward or step.

    Cost (only when validation starts inside a window): stages 1/2 one all-gather of the gradient
    slices (stage 1 a reduce-scatter first) and the full-size gradients until the next backward;
    stage 3 this rank's pieces of the sharded parameters, a slice-sized copy and no communication.
    """

    def __init__(self, engine: ZeroEngine, precision: LossScaled) -> None:
        self.engine = engine
        self.precision = precision  # its loss scale unscales the gradients

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit" or not pl_module.automatic_optimization:
            return
        self.engine.expose_window(pl_module, 1.0 / self.precision.loss_scale)
