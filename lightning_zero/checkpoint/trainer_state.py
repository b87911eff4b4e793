"""The Trainer strategy's model and optimizer states in a checkpoint: what ``lightning_module_state_dict``
gives Lightning to save (stage 3: the pieces ZeRO does not partition, or the whole model for the full
format) and the states loaded back into the engine's slices. A mixin of :class:`lightning_zero.ZeroStrategy`
beside :class:`~lightning_zero.checkpoint.trainer_saves.CheckpointWriting`; ``_State`` names what it uses
of the strategy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device

from lightning_zero import comm
from lightning_zero.checkpoint import load as ckpt_load
from lightning_zero.checkpoint import pieces as ckpt_pieces
from lightning_zero.checkpoint import rng as ckpt_rng
from lightning_zero.checkpoint.load import current_model_source

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_zero.config import StrategyConfig, ZeroConfig
    from lightning_zero.parallel.setup import ParallelSetup
    from lightning_zero.zero import ZeroEngine


class _State(Protocol):
    """What :class:`CheckpointState` reads of the strategy it is mixed into."""

    config: StrategyConfig
    _engine: ZeroEngine | None
    _module_state_out: dict[str, Any] | None
    _parallel: ParallelSetup
    _resume_rng: dict[str, Any] | None

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]: ...
    @property
    def zero_config(self) -> ZeroConfig: ...
    @property
    def root_device(self) -> torch.device: ...


class CheckpointState:
    """``lightning_module_state_dict``, ``load_model_state_dict`` and ``load_optimizer_state_dict`` of the
    Trainer strategy (see the module docstring)."""

    _module_state_out: dict[str, Any] | None  # the last lightning_module_state_dict() (stage 3, sharded)
    _resume_rng: dict[str, Any] | None  # random states to restore at the first resumed batch

    def lightning_module_state_dict(self: _State) -> dict[str, Any]:
        """Stages 1/2: the module's whole state dict, as under DDP (views of the parameters, no copy),
        so callbacks that keep it (an EMA callback moves it to ``current_model_state``) have every
        key. Stage 3: only the tensors ZeRO does not partition (frozen parameters, buffers); with
        ``state_dict_type="full"`` on rank 0 the whole one too, the partitioned parameters gathered
        one flat buffer at a time into its host memory (as FSDP's full state dict; a collective).
        ``save_checkpoint`` writes the partitioned parameters from every rank's own slices, or the
        values a hook or callback put in their place (:func:`lightning_zero.checkpoint.pieces.overrides`)."""
        assert self.lightning_module is not None
        full = self.config.checkpoint.state_dict_type == "full" and comm.initialized()
        out = ckpt_pieces.module_state_dict(self.lightning_module, self._engine, self.zero_config.stage, full=full)
        if self.zero_config.stage == 3 and not full:
            self._module_state_out = out  # see _complete_moved_module_state
        return out

    def _complete_moved_module_state(self: _State, checkpoint: dict[str, Any]) -> None:
        """Stage 3, sharded format: a callback that kept the module state under another key of the
        checkpoint (EMA's ``current_model_state``, with its averaged weights in ``state_dict``) gets
        the partitioned parameters there too, gathered into rank 0's host memory (only then: this
        is the whole model, which the checkpoint then stores beside the shards, as DDP's does).
        Call on all ranks (every rank runs the same callbacks)."""
        returned, self._module_state_out = self._module_state_out, None
        if returned is None or self._engine is None or self.zero_config.stage < 3 or not comm.initialized():
            return
        moved = [k for k, v in checkpoint.items() if k != "state_dict" and v is returned]
        if moved:
            assert self.lightning_module is not None
            full = ckpt_pieces.module_state_dict(self.lightning_module, self._engine, 3, full=True)
            for key in moved:
                checkpoint[key] = full

    def load_model_state_dict(self: _State, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        module, source = self.lightning_module, None
        if self._engine is not None and self.zero_config.stage == 3 and module._trainer is not None:
            # WeightAveraging's checkpoint: the model's own weights are in current_model_state (the
            # callback loads them into the model after this, which must then find them in place)
            source = current_model_source(checkpoint, getattr(module.trainer, "callbacks", []))
        ckpt_load.load_model(source or checkpoint, module, self._engine, self.optimizers, strict, self._parallel.layout)
        # (the callback then loads current_model_state into the model once more: whole tensors, which
        # the model's FullStateDictHooks write into each rank's shards)

    def load_optimizer_state_dict(self: _State, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        ckpt_load.replay_callback_restores(self.lightning_module)
        ckpt_load.load_optimizers(
            checkpoint, self.lightning_module, self._engine, self.optimizers, self._parallel.layout
        )
        ckpt_load.load_window(checkpoint, self._engine)  # a checkpoint saved mid accumulation window
        for optimizer in self.optimizers:
            _optimizer_to_device(optimizer, self.root_device)

    def _restore_resume_rng(self: _State, trainer: pl.Trainer | None) -> None:
        """At ``on_train_start`` of a resumed fit: the random states of the checkpoint (kept by
        ``load_checkpoint``) once more, for a mid-epoch resume."""
        if self._resume_rng is not None and trainer is not None and trainer.fit_loop.restarted_mid_epoch:
            # A mid-epoch resume has just created its train loader's iterator (drawing a base seed from the
            # random states the checkpoint restored), which the uninterrupted run did not do at that point:
            # the states are restored again, so the rest of the epoch draws what that run drew. (After an
            # epoch-end save both runs create an iterator first: nothing to undo then.)
            ckpt_rng.restore(self._resume_rng)
        self._resume_rng = None
