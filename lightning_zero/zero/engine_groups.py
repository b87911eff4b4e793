"""Parameter groups added to an optimizer during fit (a mixin of
:class:`~lightning_zero.zero.engine.ZeroEngine`): ``optimizer.add_param_group`` after setup, as
Lightning's ``BackboneFinetuning`` does when it unfreezes the backbone, partitioned into flat buffers
as if the group had been there from the start (step 1 of the data path, at a later time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_zero.config import StrategyConfig
from lightning_zero.zero.build import BuildContext
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.reduce import GradReducer
from lightning_zero.zero.released import real_parameter
from lightning_zero.zero.step import ShardedOptimizer
from lightning_zero.zero.surface import HeldParam
from lightning_zero.zero.swap import EngineSwap, ParamTier


class AddedGroups:
    """Parameter groups added during fit (see the module docstring)."""

    config: StrategyConfig
    swap: EngineSwap | None
    param_tier: ParamTier | None
    _ctx: BuildContext
    _buffers: list[FlatBuffer]
    _frozen: list[FlatBuffer]
    _sharded: dict[int, ShardedOptimizer]
    _reducer: GradReducer
    _held: list[HeldParam]

    if TYPE_CHECKING:
        # The engine's (declared for the type checker only: a stub here would be found before the
        # real method when this mixin comes first among the bases).
        def _describe(self) -> list[HeldParam]: ...

    def add_param_groups(self) -> None:
        """Partition the parameter groups added to an optimizer since setup
        (``optimizer.add_param_group`` during fit: Lightning's ``BackboneFinetuning`` unfreezing the
        backbone) into flat buffers, with masters, gradient hooks and optimizer states, as if they
        had been there from the start (their current values are every rank's: parameters are
        broadcast at setup and frozen ones do not change). Stages 1/2: buffers of their own. Stage 3:
        a frozen module's sharded buffer becomes trainable in place (:meth:`FlatBuffer.make_trainable`;
        every parameter of it must join the group), small whole parameters get persistent buckets.
        The strategy calls it before each batch, and the step before it steps (a gradient autograd
        already left in ``param.grad`` is taken). Call on all ranks."""
        known = {id(p) for b in self._buffers for p in b.params}
        for sharded in self._sharded.values():
            groups = sharded.optimizer.param_groups
            if len(groups) == len(sharded.master_params):
                continue
            new: list[FlatBuffer] = []
            for g_index in range(len(sharded.master_params), len(groups)):
                # a module attribute read outside forward gave the metadata stand-in of a released parameter
                groups[g_index]["params"] = [real_parameter(p) for p in groups[g_index]["params"]]
                params = [p for p in reversed(groups[g_index]["params"]) if p.requires_grad]
                for p in params:
                    if id(p) in known:
                        raise ValueError(
                            f"optimizer.add_param_group() gave a parameter of shape {tuple(p.shape)} that an optimizer "
                            "already holds; a parameter joins several optimizers only at setup (its flat buffer is "
                            "built for all of them): give it to each of them in configure_optimizers."
                        )
                    known.add(id(p))
                if self.config.zero.stage == 3:
                    converted = self._unfreeze_sharded(params, g_index)
                    done = {id(p) for b in converted for p in b.params}
                    params = [p for p in params if id(p) not in done]
                    new.extend(converted)
                new.extend(self._ctx.buckets(params, g_index))
            self._buffers.extend(new)
            self._reducer.add_buffers(new)
            sharded.add_groups(new)
        self._held = self._describe()

    def _unfreeze_sharded(self, params: list[nn.Parameter], g_index: int) -> list[FlatBuffer]:
        """Stage 3: the frozen sharded buffers holding ``params`` (parameters of a group added during
        fit), made trainable in place for group ``g_index``; ``ValueError`` before any change when
        one holds a parameter the group does not take, or under a disk tier."""
        ids = {id(p) for p in params}
        touched = [b for b in self._frozen if any(id(p) in ids for p in b.params)]
        for b in touched:
            left = [tuple(p.shape) for p in b.params if id(p) not in ids]
            if left:
                raise ValueError(
                    f"optimizer.add_param_group() under stage 3 took some parameters of a frozen module but not "
                    f"those of shapes {left}: a module's frozen parameters are sharded together. Add all of the "
                    "module's parameters to the group (requires_grad=True), or give the group to the optimizer in "
                    "configure_optimizers."
                )
        if touched and (self.param_tier is not None or self.swap is not None):
            raise ValueError(
                "optimizer.add_param_group() under stage 3 with a disk tier (offload_optimizer or "
                "offload_parameters='nvme') is not supported: the frozen shards live in files without masters. "
                "Give every parameter group to the optimizer in configure_optimizers (lr=0 until it should train), "
                "or use the host-memory tier."
            )
        for b in touched:
            b.make_trainable(g_index, self._ctx.separate_master, self.config.offload)
            self._frozen.remove(b)
        return touched
