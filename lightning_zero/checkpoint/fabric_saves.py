"""Fabric's ``fabric.save`` and ``fabric.load`` under ZeRO: the Trainer strategy's sharded directory
(every rank its own file), or with ``state_dict_type="full"`` one file from rank 0, and any of them
loaded back into the set-up model, its optimizers and the rest of the user's ``state``
(:mod:`lightning_zero.checkpoint.fabric_state` maps one format onto the other). A mixin of
:class:`~lightning_zero.fabric.FabricZeroStrategy`, kept apart so that the strategy file holds
Fabric's calls; ``_Saving`` names what it uses of the strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.utilities.types import _PATH
from torch import nn

from lightning_zero.checkpoint import fabric_state
from lightning_zero.checkpoint import load as ckpt_load
from lightning_zero.fabric_plugins import explained, inner, load_file

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from lightning_zero.config import StrategyConfig
    from lightning_zero.fabric_plugins import FabricOffloadPrecision
    from lightning_zero.zero import ZeroEngine


class _Saving(Protocol):
    """What :class:`FabricCheckpoints` reads of the strategy it is mixed into."""

    config: StrategyConfig
    _engine: ZeroEngine | None
    _module: nn.Module | None
    _optimizers: list[torch.optim.Optimizer]
    _optimizer_states_loaded: bool

    @property
    def precision(self) -> FabricOffloadPrecision: ...
    @property
    def global_rank(self) -> int: ...
    def _explaining(self) -> AbstractContextManager[None]: ...
    def _ensure_built(self) -> None: ...
    def _adopt(self, module: nn.Module) -> None: ...
    def _load_state(self, checkpoint: dict[str, Any], state: dict[str, Any], strict: bool) -> dict[str, Any]: ...
    def _saved_module(self) -> nn.Module: ...


class FabricCheckpoints:
    """``save_checkpoint`` and ``load_checkpoint`` of the Fabric strategy (see the module docstring)."""

    _optimizer_states_loaded: bool  # then setup_optimizers can no longer rebuild the engine

    @explained
    def save_checkpoint(
        self: _Saving,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write the sharded directory ``path`` (every rank its own file), in the Trainer strategy's format."""
        if storage_options is not None or filter is not None:
            raise ValueError(
                "fabric.save(..., filter=...) and storage_options are not supported by ZeroStrategy: the sharded "
                "format holds every parameter piece of every rank; save without them."
            )
        self._ensure_built()
        state = {k: inner(v) for k, v in state.items()}
        module, engine, stage = self._saved_module(), self._engine, self.config.zero.stage
        full = self.config.checkpoint.state_dict_type == "full"
        args = (path, state, module, engine, self._optimizers, self.precision)
        fabric_state.save(*args, stage=stage, full=full, rank=self.global_rank)

    @explained
    def load_checkpoint(
        self: _Saving,
        path: _PATH,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a sharded directory (Fabric's or the Trainer's, any world size or stage) or a plain file
        (a Fabric DDP checkpoint, a Lightning one, or with ``state`` a module: a raw state dict)."""
        checkpoint = ckpt_load.load_checkpoint(
            path, weights_only, self.global_rank, lambda p: load_file(p, weights_only)
        )
        if not state:
            return checkpoint
        self._ensure_built()
        if isinstance(state, dict):
            unwrapped = {k: inner(v) for k, v in state.items()}
            remainder = self._load_state(checkpoint, unwrapped, strict)
            state.update({k: v for k, v in unwrapped.items() if not isinstance(v, (nn.Module, torch.optim.Optimizer))})
            return remainder
        state = inner(state)
        if isinstance(state, nn.Module):  # fabric.load_raw: a plain state dict of the model
            self._adopt(state)
            ckpt_load.load_model({"state_dict": checkpoint}, state, self._engine, self._optimizers, strict)
            return {}
        if isinstance(state, torch.optim.Optimizer):
            raise ValueError(
                "fabric.load_raw(path, optimizer) is not supported by ZeroStrategy; save and load the optimizer "
                "with the model: fabric.save(path, {'model': model, 'optimizer': optimizer})."
            )
        raise TypeError(f"fabric.load(path, state): state must be a dict, a module or an optimizer, not {type(state)}.")

    def _load_state(self: _Saving, checkpoint: dict[str, Any], state: dict[str, Any], strict: bool) -> dict[str, Any]:
        keys = fabric_state.split_state(state, self._module, self._optimizers)
        module = self._saved_module()
        self._optimizer_states_loaded |= bool(keys.optimizers)
        return fabric_state.restore(
            checkpoint, state, keys, module, self._engine, self._optimizers, self.precision, strict
        )

    def _saved_module(self: _Saving) -> nn.Module:
        if self._module is None:
            raise ValueError("fabric.save/load before the model was set up: call fabric.setup(model, optimizer) first.")
        return self._module
