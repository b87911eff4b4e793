"""How Fabric's calls set a model and its optimizers up under ZeRO: ``fabric.setup``,
``fabric.setup_module`` and ``fabric.setup_optimizers`` (one engine for the model and all of its
optimizers, rebuilt when Fabric hands them over one at a time), and the hooks the strategy puts on the
set-up model. A mixin of :class:`~lightning_zero.fabric.FabricZeroStrategy`, kept apart so that the
strategy file holds Fabric's calls; ``_Setup`` names what it uses of the strategy.

The order of the lifecycle's steps (meta-device check, space check, activation checkpointing, the
engine, the model's last move and cast, the precision attached) is :meth:`lightning_zero.lifecycle.Lifecycle.build`'s,
the same as the Trainer strategy's ``setup``. What is Fabric's own:

* ``fabric.setup(model, *optimizers)`` builds the engine once, for every optimizer.
* ``fabric.setup_module(model)`` then ``fabric.setup_optimizers(...)``: stages 1/2 make every rank's
  weights rank 0's and wait for the optimizers; stage 3 waits for them too (the model Fabric calls
  builds the engine at its first forward if none came), except for a model built under
  ``fabric.init_module()``, which is built into its shards at once (an optimizer cannot be made over
  meta parameters). An optimizer set up after the engine exists rebuilds it for all of them from the
  weights it holds (:meth:`FabricSetup._rebuild_for`), until the first step or optimizer-state load.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import nn

from lightning_zero import comm
from lightning_zero.checkpoint.module_state import FullStateDictHooks
from lightning_zero.fabric_plugins import BuildOnFirstForward, explained
from lightning_zero.lifecycle import on_meta
from lightning_zero.lockstep import Lockstep
from lightning_zero.zero import ModelParallelContext

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from lightning_zero.config import StrategyConfig
    from lightning_zero.ddp_args import BufferSync
    from lightning_zero.fabric_plugins import FabricOffloadPrecision
    from lightning_zero.lifecycle import Lifecycle
    from lightning_zero.zero import ZeroEngine


class _Setup(Protocol):
    """What :class:`FabricSetup` reads of the strategy it is mixed into (set by its ``__init__``)."""

    config: StrategyConfig
    _life: Lifecycle
    _engine: ZeroEngine | None
    _module: nn.Module | None
    _optimizers: list[torch.optim.Optimizer]
    _deferred: bool
    _state_hooks: FullStateDictHooks | None
    _lockstep: Lockstep | None
    _watch_hook: Any
    _eval_hook: Any
    _buffers_hooks: list[Any]
    _buffer_sync: BufferSync
    _steps: int
    _optimizer_states_loaded: bool

    @property
    def precision(self) -> FabricOffloadPrecision: ...
    @property
    def data_parallel_group(self) -> comm.ProcessGroup: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def _explaining(self) -> AbstractContextManager[None]: ...
    def _end_continuation(self) -> None: ...
    def _ensure_built(self) -> None: ...
    def _adopt(self, module: nn.Module) -> None: ...
    def _build(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None: ...
    def _rebuild_for(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None: ...
    def _check_optimizers(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None: ...
    def _remove_hooks(self) -> None: ...
    def _before_forward(self, module: nn.Module, args: Any) -> None: ...
    def _end_eval_pass(self, module: nn.Module, args: Any, output: Any) -> None: ...


class FabricSetup:
    """``setup_module_and_optimizers``, ``setup_module``, ``setup_optimizer`` and ``module_to_device`` of
    the Fabric strategy, and the hooks on the set-up model (see the module docstring)."""

    # what these methods assign (the strategy's __init__ sets them first)
    _engine: ZeroEngine | None
    _module: nn.Module | None
    _optimizers: list[torch.optim.Optimizer]
    _deferred: bool
    _state_hooks: FullStateDictHooks | None
    _lockstep: Lockstep | None
    _watch_hook: Any
    _eval_hook: Any
    _buffers_hooks: list[Any]

    def module_to_device(self: _Setup, module: nn.Module) -> None:
        if not on_meta(module):  # stage 3 materializes a recorded model in setup
            module.to(self.root_device)

    @explained
    def setup_module_and_optimizers(
        self: _Setup, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        """``fabric.setup(model, *optimizers)``: one engine for the model and every optimizer."""
        self._end_continuation()
        self._adopt(module)
        self._build(module, optimizers)
        return module, optimizers, scheduler

    @explained
    def setup_module(self: _Setup, module: nn.Module) -> nn.Module:  # not wrapped, unlike DDP's
        """``fabric.setup_module(model)``. Stage 3 builds the engine when it is first needed: at
        ``fabric.setup_optimizers`` (Fabric's order for FSDP: the optimizer is built from the set-up
        model's parameters, which are the model's own), else at the first forward, save, load or
        ``gathered_parameters``. A model built under ``fabric.init_module()`` is built into its shards
        now (an optimizer cannot be made over meta parameters) and rebuilt at ``setup_optimizers``.
        Stages 1/2 make every rank's weights rank 0's and build the engine at ``setup_optimizers``."""
        self._end_continuation()
        self._adopt(module)
        if self.config.zero.stage == 3 and on_meta(module):
            # Built now: Fabric refuses an optimizer over meta parameters, so the optimizer comes after
            # this build, and setup_optimizers rebuilds the engine for it (see _rebuild_for).
            self._build(module, [])
            return module
        if self.config.zero.stage == 3:
            self._deferred = True
            return BuildOnFirstForward(module, self._ensure_built)
        self._life.check_meta(module)
        comm.broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), None)
        return module

    def _ensure_built(self: _Setup) -> None:
        """Stage 3 after ``setup_module`` alone: build the engine without an optimizer (evaluation,
        or a save or load before ``setup_optimizers``). Call on all ranks."""
        if self._deferred and self._engine is None and self._module is not None:
            self._deferred = False
            self._build(self._module, [])

    @explained
    def setup_optimizer(self: _Setup, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``fabric.setup_optimizers(opt1, opt2, ...)`` after ``setup_module``: Fabric hands them over one
        at a time, so each one after the first rebuilds the engine for all of them (:meth:`_rebuild_for`);
        allowed until the first step or optimizer-state load."""
        if self._module is None:
            raise ValueError(
                "fabric.setup_optimizers() before the model was set up: ZeRO partitions the model's parameters "
                "for its optimizers; call fabric.setup(model, optimizer) (or setup_module first)."
            )
        if any(optimizer is o for o in self._optimizers):
            raise ValueError(f"{type(optimizer).__name__} was already set up with this model; set it up once.")
        if self._engine is not None and (self._steps or self._optimizer_states_loaded):
            raise ValueError(
                f"fabric.setup_optimizers() after {self._steps} optimizer step(s)"
                f"{' and a load of optimizer states' if self._optimizer_states_loaded else ''} (stage "
                f"{self.config.zero.stage}, {len(self._optimizers)} optimizer(s) set up): ZeRO partitions a model "
                "once for all of its optimizers and keeps their states in its shards; set every optimizer up before "
                "the first step and the first fabric.load: fabric.setup_optimizers(optimizer1, optimizer2)."
            )
        self._deferred = False
        if self._engine is not None:
            self._rebuild_for(self._module, [*self._optimizers, optimizer])
        else:
            self._build(self._module, [optimizer])
        return optimizer

    def _rebuild_for(self: _Setup, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """``setup_optimizers`` after the engine was built without ``optimizers[-1]`` (stage 3: a forward,
        save or load came between ``setup_module`` and it, or the model was built under ``init_module``;
        any stage: an earlier optimizer of the same ``setup_optimizers`` call): the engine is rebuilt for
        all of ``optimizers`` from the weights it holds, the fp32 masters where it keeps them, so the
        result equals ``fabric.setup(model, *optimizers)`` (under mixed precision a stage-3 engine built
        without an optimizer keeps no fp32 master: the weights then start from their compute-dtype
        values). Costs the whole model on every rank for the rebuild. Call on all ranks."""
        assert self._engine is not None
        new = optimizers[-1]
        if any(new.state.get(p) for g in new.param_groups for p in g["params"]):
            raise ValueError(
                f"{type(new).__name__} already has state (it stepped before fabric.setup_optimizers); "
                "ZeRO builds the optimizer states in its shards: set the optimizer up before its first step."
            )
        whole = self._engine.full_params(keep=True)  # a collective: every rank gets every weight
        self._remove_hooks()
        self._engine.close(unshard=False)
        self._engine = None
        with torch.no_grad():
            for param in module.parameters():
                if id(param) in whole:
                    param.data = whole[id(param)].to(self.root_device)
        del whole
        self._build(module, optimizers)

    def _adopt(self: _Setup, module: nn.Module) -> None:
        if self._module is not None and self._module is not module:
            raise ValueError(
                "a second model was set up with this ZeroStrategy; it partitions one model: put the models into "
                "one nn.Module (with one optimizer per part if needed) and call fabric.setup once."
            )
        self._module = module
        self.precision.explain_failures = self._explaining  # around each forward (stage 3 gathers)

    def _check_optimizers(self: _Setup, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """Every parameter of every optimizer belongs to ``module``: ZeRO partitions the model's parameters."""
        mine = {id(p) for p in module.parameters()}
        for index, optimizer in enumerate(optimizers):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            foreign = [p for p in params if id(p) not in mine]
            if foreign:
                raise ValueError(
                    f"optimizer {index} ({type(optimizer).__name__}) holds {len(foreign)} of its {len(params)} "
                    f"parameters outside the model (e.g. of shape {tuple(foreign[0].shape)}): ZeRO partitions the "
                    "model's own parameters; build the optimizer from model.parameters() of the model given to "
                    "fabric.setup."
                )

    def _build(self: _Setup, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """The Trainer strategy's ``setup`` (:meth:`lightning_zero.lifecycle.Lifecycle.build`), for a model
        and optimizers given by the user; then the hooks on the model. Call on all ranks."""
        stage3 = self.config.zero.stage == 3
        self._life.check_meta(module)
        self._check_optimizers(module, optimizers)
        precision, device = self.precision, self.root_device
        move, cast = (lambda: module.to(device)), (lambda: precision.cast_module(module))
        parallel = ModelParallelContext(data=self.data_parallel_group)
        self._engine = self._life.build(
            module,
            list(optimizers),
            precision,
            device,
            parallel,
            processes=self.num_processes,
            training=bool(optimizers),  # without an optimizer (stage 3 evaluation) nothing steps
            move=move,
            cast=cast,
        )
        self._optimizers = list(optimizers)
        _optimizers_to_device(optimizers, device)
        if stage3:
            # The model's forward is Fabric's step: it may read any parameter (gathered on use).
            self._engine.step_on_root_forward()
            # A forward without backward (evaluation) ends its pass here; backward_done ends the others.
            self._eval_hook = module.register_forward_hook(self._end_eval_pass)
        if not self._buffers_hooks:
            sync, ddp = self._buffer_sync, self.config.data_parallel
            before = module.register_forward_pre_hook(lambda m, a: sync.before(ddp, m, self.data_parallel_group))
            self._buffers_hooks = [before, module.register_forward_hook(lambda m, a, o: sync.after())]
        # model.load_state_dict(full) loads into the shards; stage 3 model.state_dict() gathers (as FSDP's)
        self._state_hooks = FullStateDictHooks(module, self._engine, full_state_dict=stage3)
        sharded = any(tuple(h.param.shape) != tuple(h.shape) for h in self._engine.held_params())
        store = comm.default_store()
        if stage3 and sharded and store is not None and self.world_size > 1:
            if self._lockstep is None:
                run = str(next(_RUNS))  # the same on every rank: each rank makes the same strategies
                timeout = self.config.failure.collective_timeout
                self._lockstep = Lockstep(store, self.global_rank, self.world_size, timeout, run)
            # before the engine's own hooks: the check comes before the first all-gather
            self._watch_hook = module.register_forward_pre_hook(self._before_forward, prepend=True)

    def _before_forward(self: _Setup, module: nn.Module, args: Any) -> None:
        if self._lockstep is not None:
            self._lockstep.before_forward(type(module).__name__)

    def _end_eval_pass(self: _Setup, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() and self._engine is not None:
            self._engine.end_pass()

    def _remove_hooks(self: _Setup) -> None:
        if self._eval_hook is not None:
            self._eval_hook.remove()
            self._eval_hook = None
        if self._state_hooks is not None:
            self._state_hooks.remove()
            self._state_hooks = None
        if self._watch_hook is not None:
            self._watch_hook.remove()
            self._watch_hook = None
        for hook in self._buffers_hooks:
            hook.remove()
        self._buffers_hooks = []


_RUNS = itertools.count()  # Fabric ZeroStrategy runs of this process: the same sequence on every rank
