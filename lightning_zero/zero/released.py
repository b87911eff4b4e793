"""What a released (sharded, not gathered) stage-3 parameter looks like to code that reads it.

* :class:`ReleasedParameter`: returned by a module attribute read of a released parameter outside
  any forward or step (a callback, a hook between steps). It carries the full parameter's metadata
  (``.dtype``, ``.device``, ``.requires_grad``, ``.shape``/``.size()``, ``.ndim``/``.dim()``,
  ``.numel()``, ``.is_floating_point()``) and no data: reading metadata never gathers, and any use
  of its values raises the error that says where they can be read.
* :class:`GatherOnUse`: a ``TorchFunctionMode`` active during a training/validation/test/predict
  step (and the root module's forward): the first op that takes a released parameter as an input
  (an L2 penalty over ``self.parameters()``, which bypasses the modules' attribute guard) gathers
  it first, as every rank's same op does (a collective at the same point of the same code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def read_error(name: str) -> RuntimeError:
    """The error for a value read of released parameter ``name`` outside any forward or step."""
    return RuntimeError(
        f"parameter {name!r} is sharded by ZeRO stage 3 and was read outside the forward of the module that "
        "owns it, where it holds no data. Read it inside `with trainer.strategy.gathered_parameters(module):` "
        "(Fabric: `with fabric.strategy.gathered_parameters(module):`), or use it through its module's forward (or in a training/validation/test/predict step, where every "
        "parameter is gathered on use). Metadata (.shape, .dtype, .device, .requires_grad) can be read anywhere."
    )


_META_PROPERTIES = (
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "ndim",
    "is_leaf",
    "layout",
    "is_cuda",
    "is_meta",
    "is_sparse",
    "is_quantized",
    "grad",
)
#: what a :class:`ReleasedParameter` answers: metadata, never values
_META: set[Any] = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.element_size,
    torch.Tensor.__hash__,
} | {getattr(torch.Tensor, name).__get__ for name in _META_PROPERTIES}


_FREEZE: set[Any] = {torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__}  # type: ignore[attr-defined]


def real_parameter(value: Any) -> Any:
    """The parameter behind a :class:`ReleasedParameter`; anything else as it is."""
    return value._param if isinstance(value, ReleasedParameter) else value


class ReleasedParameter(torch.Tensor):
    """Metadata of a released stage-3 parameter, without data (a tensor of the full shape, dtype,
    device and ``requires_grad``); every other use raises :func:`read_error`."""

    _param_name: str
    _param: nn.Parameter

    @staticmethod
    def __new__(cls, param: nn.Parameter, shape: torch.Size, name: str) -> ReleasedParameter:
        made = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=param.dtype, device=param.device, requires_grad=param.requires_grad
        )
        made._param_name = name
        made._param = param  # requires_grad_ reaches it; optimizer.add_param_group takes it (engine)
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ReleasedParameter({self._param_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func in _FREEZE and isinstance(args[0], ReleasedParameter):
            # freezing or unfreezing (a fine-tuning callback) changes the parameter itself
            with torch._C.DisableTorchFunctionSubclass():
                func(args[0]._param, *args[1:], **(kwargs or {}))
                func(*args, **(kwargs or {}))
            return args[0] if func is torch.Tensor.requires_grad_ else None
        raise read_error(next((a._param_name for a in args if isinstance(a, ReleasedParameter)), "?"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise read_error(next((a._param_name for a in args if isinstance(a, ReleasedParameter)), "?"))


_ACCESSORS = ("__get__", "__set__", "__delete__")


class GatherOnUse(TorchFunctionMode):
    """Calls ``gather(param)`` before any op whose inputs include a released sharded parameter
    (``released(value)``: False for anything else, answered from an id lookup); the op then runs on the full parameter. Looks at the op's positional and
    keyword arguments and one level of lists/tuples in them (``torch.stack([...])``, foreach ops)."""

    def __init__(self, released: Callable[[Any], bool], gather: Callable[[nn.Parameter], None]) -> None:
        super().__init__()
        self._released = released
        self._gather = gather

    def _visit(self, value: Any) -> None:
        if type(value) in (list, tuple):
            for item in value:
                if self._released(item):
                    self._gather(item)
        elif self._released(value):
            self._gather(value)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Metadata, attribute reads and writes (``p.numel()``, ``p.grad = None``, the gather's own
        # ``p.data = ...``) need no data; gathering there would re-enter the gather that is binding
        # the parameter, or turn the engine's own bookkeeping of released parameters into gathers.
        if torch.compiler.is_compiling():  # traced code: the module hooks (graph breaks) gather
            return func(*args, **kwargs)
        if func not in _META and getattr(func, "__name__", "") not in _ACCESSORS:
            for value in args:
                self._visit(value)
            for value in kwargs.values():
                self._visit(value)
        return func(*args, **kwargs)
