"""Stage 3's guard on modules holding sharded parameters, and the flags that change what it does.

* :func:`guarded_class`: the subclass that :class:`~lightning_zero.zero.gather.GatherCoordinator`
  gives each module holding sharded parameters (and takes back at teardown). Its ``__getattr__``
  asks the module's coordinator about a released parameter (gathered on use inside a forward or
  step, a metadata-only :class:`~lightning_zero.zero.released.ReleasedParameter` elsewhere); its
  ``state_dict()`` refuses to return placeholders outside :func:`placeholders_allowed`; a guarded
  RNN keeps its flat weight list pointing at the Parameter objects.
* :func:`placeholders_allowed` / :func:`placeholders_ok`: the checkpoint code's licence to read
  ``state_dict()`` of a sharded model (it writes those parameters from the shards instead).
* :func:`recomputing` / :func:`recompute_contexts`: activation checkpointing's recompute inside
  backward, during which the gather hooks gather what it reads and leave the prefetch trace alone
  (:data:`RECOMPUTING` is what they read).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

_GUARDED: dict[type, type] = {}
# Set while the checkpoint code reads ``state_dict()`` knowing that sharded parameters are placeholders.
_PLACEHOLDERS_OK: contextvars.ContextVar[bool] = contextvars.ContextVar("placeholders_ok", default=False)
# Set while activation checkpointing recomputes a forward inside backward (read by the gather hooks).
RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("recomputing", default=False)


@contextlib.contextmanager
def placeholders_allowed() -> Iterator[None]:
    """``module.state_dict()`` may return the empty placeholders of sharded parameters inside this
    block (the checkpoint code, which writes those parameters from the shards instead)."""
    token = _PLACEHOLDERS_OK.set(True)
    try:
        yield
    finally:
        _PLACEHOLDERS_OK.reset(token)


def placeholders_ok() -> bool:
    """Whether the caller is inside :func:`placeholders_allowed`."""
    return _PLACEHOLDERS_OK.get()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Marks the recompute of a checkpointed forward (inside backward): the gather hooks gather what it
    reads, keep it gathered for the backward that follows, and leave the prefetch trace alone."""
    token = RECOMPUTING.set(True)
    try:
        yield
    finally:
        RECOMPUTING.reset(token)


def recompute_contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint``: nothing around the first forward,
    :func:`recomputing` around the recompute."""
    return contextlib.nullcontext(), recomputing()


def guarded_class(cls: type) -> type:
    """``cls`` whose attribute reads of released parameters go through the coordinator (gathered on
    use inside a forward or step, a metadata-only :class:`ReleasedParameter` elsewhere); cached per class."""
    if cls not in _GUARDED:

        def __getattr__(self: nn.Module, name: str) -> Any:
            # mypy cannot see that ``guarded`` (made below with type()) is a class
            value = super(guarded, self).__getattr__(name)  # type: ignore[arg-type]
            coordinator = self.__dict__.get("_lightning_zero_coordinator")
            if coordinator is not None and isinstance(value, nn.Parameter) and coordinator.is_released(value):
                return coordinator.released_read(value)
            return value

        def _save_to_state_dict(self: nn.Module, destination: Any, prefix: str, keep_vars: bool) -> None:
            super(guarded, self)._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[arg-type]  # as above
            coordinator = self.__dict__.get("_lightning_zero_coordinator")
            if coordinator is None or keep_vars or _PLACEHOLDERS_OK.get():
                return  # keep_vars: the Parameter objects themselves are asked for, not their values
            for name, param in self._parameters.items():
                if param is not None and coordinator.is_released(param):
                    raise RuntimeError(
                        f"state_dict() of {type(self).__name__} under ZeRO stage 3 outside a forward: its parameter "
                        f"{prefix + name!r} is sharded and holds no data here. Call it inside "
                        "`with trainer.strategy.gathered_parameters(module):` on every rank, save with "
                        "trainer.save_checkpoint, or read it after fit (the parameters are whole again). Under "
                        "Fabric, model.state_dict() gathers a full state dict on every rank (call it on all ranks); "
                        "save with fabric.save."
                    )

        members = {"__getattr__": __getattr__, "_save_to_state_dict": _save_to_state_dict, "__module__": cls.__module__}
        if issubclass(cls, nn.RNNBase):
            members.update(_rnn_members())
        guarded = type(cls.__name__, (cls,), members)
        guarded.__qualname__ = cls.__qualname__
        _GUARDED[cls] = guarded
    return _GUARDED[cls]


def _rnn_members() -> dict[str, Any]:
    """What a guarded ``nn.RNNBase`` (GRU, LSTM, RNN) changes: the RNN's forward passes its
    ``_flat_weights`` list (the Parameter objects themselves, so they see each gather and release) to
    the kernel. That list is rebuilt by ``_init_flat_weights`` (on ``module.to()``, ``float()``,
    unpickling), which reads the weights through ``__getattr__``: here it takes the Parameter objects
    from ``_parameters`` without the guard, since keeping references is not reading values.
    ``flatten_parameters`` (cuDNN's single weight buffer, which re-points every weight into it) is a
    no-op while ZeRO owns the parameters' storage; cuDNN then runs on the separate weights."""

    def _init_flat_weights(self: nn.RNNBase) -> None:
        own = self._parameters
        self._flat_weights = [own[n] if n in own else getattr(self, n, None) for n in self._flat_weights_names]
        self._flat_weight_refs = [weakref.ref(w) if w is not None else None for w in self._flat_weights]

    def flatten_parameters(self: nn.RNNBase) -> None:
        return None

    return {"_init_flat_weights": _init_flat_weights, "flatten_parameters": flatten_parameters}
