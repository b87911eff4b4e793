"""The types of the engine's surface: what other layers give the engine and get back from it.

Checkpointing, the memory report, parallel setup, failure reporting and the precision plugin see the
engine's state only through these records and the methods of :class:`~lightning_zero.zero.engine.ZeroEngine`
that return them; flat buffers, the sharded optimizer and the gradient reducer stay inside ``zero/``.

* :class:`ModelParallelContext`: the process groups and the parameters tied across pipeline stages,
  given at construction (the engine never reaches for a group by itself).
* :class:`HeldParam`: one parameter the engine holds in a flat buffer, with where its pieces are on
  every rank (checkpoint metadata) and on this one.
* :class:`LocalPiece`: this rank's piece of one parameter (fp32 master and optimizer states), the
  unit a checkpoint writes; :class:`OptimizerPiece` the optimizer-state part that loading reads back.
* :class:`ParamGroup`: an optimizer parameter group as the user built it (hyperparameters and the
  original parameters), which the engine rewired to master slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_zero import comm


@dataclass(frozen=True)
class TiedAcrossStages:
    """A parameter of which another pipeline stage holds a copy (e.g. the LM head's embedding)."""

    param: nn.Parameter
    group: comm.ProcessGroup
    """This rank and the ranks of the other stages holding the copy (same data/tensor coordinates)."""
    counted_here: bool
    """True on the first stage holding it: the global gradient norm counts it there only."""


@dataclass(frozen=True, kw_only=True)
class ModelParallelContext:
    """The groups the engine works over. ``None`` is "no such parallelism" for ``tensor`` and
    ``pipeline``, and the default group for ``data``."""

    data: comm.ProcessGroup = None
    """The data-parallel group ZeRO shards over."""
    tensor: comm.ProcessGroup = None
    """Parameters marked ``tensor_parallel`` are split over it; the others are replicas."""
    pipeline: comm.ProcessGroup = None
    """Every stage holds other parameters: gradient norms add up over it."""
    tied: tuple[TiedAcrossStages, ...] = field(default_factory=tuple)
    """Parameters tied across pipeline stages: their gradients are summed over their group."""


@dataclass(frozen=True)
class HeldParam:
    """One parameter held in one of the engine's flat buffers."""

    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    """The compute dtype (of the parameter in the module)."""
    saved_dtype: torch.dtype
    """The dtype of its master slice (fp32 under mixed precision): what a checkpoint stores."""
    optimizers: tuple[int, ...]
    """Indices of the optimizers holding it in the list the engine was built with: usually one;
    several for a parameter given to several optimizers (each with its own state of the same
    master); none for a frozen parameter that stage 3 partitions without an optimizer."""
    buffer: int
    """Index of its flat buffer (pieces of one buffer share one copy when saved)."""
    pieces: tuple[tuple[int, int, int], ...]
    """``(rank, param_offset, numel)`` of its piece on every data-parallel rank holding one."""
    local: tuple[int, int, int] | None
    """``(param_offset, shard_offset, numel)`` of its piece in this rank's slice, if any."""

    @property
    def optimizer(self) -> int | None:
        """Its first optimizer's index, ``None`` when frozen."""
        return self.optimizers[0] if self.optimizers else None


@dataclass(frozen=True)
class OptimizerPiece:
    """One optimizer's state of one piece."""

    slices: dict[str, torch.Tensor]
    """States with one element per parameter element (``exp_avg``), each (numel,)."""
    scalars: dict[str, Any]
    """The other states (``step``), shared by the pieces of one flat buffer."""


@dataclass(frozen=True)
class LocalPiece:
    """This rank's piece of one parameter, in host memory, ready to be written."""

    master: torch.Tensor
    """(numel,) the piece of the master slice (dtype :attr:`HeldParam.saved_dtype`)."""
    states: dict[int, OptimizerPiece]
    """Per optimizer holding it (:attr:`HeldParam.optimizers`), that optimizer's state of the piece."""


@dataclass(frozen=True)
class ParamGroup:
    """One parameter group of a ZeRO-managed optimizer, as ``configure_optimizers`` built it."""

    hyper: dict[str, Any]
    """Its options (``lr``, ``betas``, ...), read live: schedulers change them."""
    params: tuple[nn.Parameter, ...]
    """The original parameters (the optimizer itself steps master slices)."""


PieceReader = Callable[[HeldParam, int, int], torch.Tensor | None]
"""``read(param, param_offset, numel)``: the values of that piece of ``param``, or None to keep it."""

OptimizerPieceReader = Callable[[HeldParam, int, int], OptimizerPiece | None]
"""``read(param, param_offset, numel)``: the optimizer state of that piece, or None (no state)."""
