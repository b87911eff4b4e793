"""What Fabric calls besides :class:`~lightning_zero.fabric.FabricZeroStrategy` itself: its precision plugin,
its backward-sync control, the module stage 3's ``setup_module`` returns, the plain checkpoint files it
reads, and the decorator that explains a failure in a strategy method that communicates."""

from __future__ import annotations

import functools
import zipfile
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_zero.ddp_args import BufferSync
from lightning_zero.precision import OffloadPrecision


# (mypy: Fabric's HalfPrecision sets _desired_input_dtype as an attribute; OffloadPrecision derives it.)
class FabricOffloadPrecision(OffloadPrecision, FabricHalfPrecision):  # type: ignore[override]
    """:class:`~lightning_zero.OffloadPrecision` as Fabric calls it.

    Fabric casts the model before the strategy sets it up; ZeRO builds its fp32 masters from the
    values the user built, so the cast waits for the engine (the strategy calls
    :meth:`cast_module`). Outputs return in the default dtype, as from Fabric's own precision plugins.
    Fabric's ``HalfPrecision`` is a base only so that Fabric's ``ThroughputMonitor`` reads the compute
    dtype (``_desired_input_dtype``), as the Trainer's does through ``OffloadPrecision``; every method
    it defines is overridden.
    """

    #: Set by the strategy: the context that explains a failed collective (see ``FabricZeroStrategy``).
    explain_failures: Callable[[], AbstractContextManager] | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # cast_module, after the engine has taken the masters

    def cast_module(self, module: nn.Module) -> nn.Module:
        return super().convert_module(module)

    def forward_context(self) -> AbstractContextManager:  # type: ignore[override]  # as OffloadPrecision
        return self._forward_context()

    @contextmanager
    def _forward_context(self) -> Generator[None, None, None]:
        # _FabricModule runs every forward in here: stage 3's gathers are collectives that name a lost rank
        explain = self.explain_failures() if self.explain_failures is not None else nullcontext()
        with explain, super().forward_context():
            yield

    def convert_output(self, data: Any) -> Any:
        if self.compute_dtype == torch.get_default_dtype():
            return data
        dtype = torch.get_default_dtype()
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def explained(method: _Method) -> _Method:
    """A method of a strategy with ``_explaining()`` (:class:`~lightning_zero.fabric.FabricZeroStrategy`) that
    communicates: a failure in it is explained (a lost rank named, out-of-memory advice)."""

    @functools.wraps(method)
    def explained(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._explaining():
            return method(self, *args, **kwargs)

    return cast(_Method, explained)


class ZeroBackwardSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: ZeRO's gradients have nothing to skip (see :mod:`lightning_zero.fabric`);
    buffers are broadcast as around DDP's ``no_sync`` (:class:`~lightning_zero.ddp_args.BufferSync`)."""

    def __init__(self, buffers: BufferSync) -> None:
        self.buffers = buffers

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return self.buffers.blocking() if enabled else nullcontext()


class BuildOnFirstForward(nn.Module):
    """What stage 3's ``setup_module`` returns for Fabric to call: the model, whose engine is built
    (without an optimizer) at the first forward when ``setup_optimizers`` did not build it before.
    A module of its own so that the engine's gather hooks, registered by the build, are in place
    before the model's own ``__call__`` runs them."""

    def __init__(self, module: nn.Module, build: Callable[[], None]) -> None:
        super().__init__()
        self.module = module
        self._build = build

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _build_now(self._build)
        return self.module(*args, **kwargs)


@torch.compiler.disable
def _build_now(build: Callable[[], None]) -> None:
    build()


def load_file(path: Any, weights_only: bool | None) -> Any:
    """A plain checkpoint file. A local one in torch's zip format is memory-mapped: each rank then
    reads only the bytes of its own pieces (``load_raw`` of a whole model streams it), and ranks on
    one host share the page cache. Anything else (a remote path, the legacy format) as Fabric reads it."""
    local = Path(str(path))
    if local.is_file() and zipfile.is_zipfile(local):
        return torch.load(local, map_location="cpu", mmap=True, weights_only=bool(weights_only))
    return pl_load(Path(path), weights_only=weights_only)


def inner(obj: Any) -> Any:
    """The model itself for what Fabric hands the strategy (its forward module) of stage 3's ``setup_module``."""
    return obj.module if isinstance(obj, BuildOnFirstForward) else obj
