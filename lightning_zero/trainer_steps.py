"""What the Trainer strategy does in every step: the base class of :class:`lightning_zero.ZeroStrategy`.

Lightning calls a strategy's step methods for every batch; under ZeRO each of them runs inside the
engine's step scope (stage 3: any parameter may be read, gathered on use) and ends the engine's pass;
fit's forwards broadcast buffers as DDP's forward does (``broadcast_buffers``,
:class:`~lightning_zero.ddp_args.BufferSync`); under pipeline parallelism the strategy runs the
schedule over the micro-batches in place of the LightningModule's step. :class:`TrainerSteps` holds
these hooks and the process groups they run over, as a ``DDPStrategy`` (they call its own step
methods), so that ``strategy.py`` holds construction, setup and teardown and the public calls.
The attributes annotated below are set by ``ZeroStrategy.__init__`` and its ``setup``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_zero import comm
from lightning_zero.precision import OffloadPrecision

if TYPE_CHECKING:
    from lightning_zero.config import StrategyConfig
    from lightning_zero.ddp_args import BufferSync
    from lightning_zero.lifecycle import Lifecycle
    from lightning_zero.lockstep import StepLockstep
    from lightning_zero.parallel.setup import ParallelSetup
    from lightning_zero.zero import ZeroEngine


class TrainerSteps(DDPStrategy):
    """The step hooks and process groups of :class:`lightning_zero.ZeroStrategy` (see the module docstring)."""

    config: StrategyConfig
    _engine: ZeroEngine | None
    _life: Lifecycle
    _parallel: ParallelSetup
    _buffer_sync: BufferSync
    _steplock: StepLockstep | None

    # -- process groups ------------------------------------------------------------------------------

    @property
    def data_parallel_group(self) -> comm.ProcessGroup:
        """The group ZeRO shards over (the default group without tensor parallelism), wrapped in a
        :class:`~lightning_zero.comm.CheckedGroup` when ``debug_collectives`` is on."""
        checked = self._life.checked_group
        return checked if checked is not None else self._parallel.dp_group

    @property
    def tensor_parallel_group(self) -> comm.ProcessGroup:
        """This rank's tensor-parallel group (``None`` without tensor parallelism)."""
        return self._parallel.tp_group

    @property
    def pipeline_parallel_group(self) -> comm.ProcessGroup:
        """This rank's pipeline-parallel group (``None`` without pipeline parallelism)."""
        return self._parallel.pp_group

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over the data-parallel ranks: the ranks of one tensor-parallel group see the same batch."""
        return self._parallel.sampler_kwargs(self.num_nodes * self.num_processes, self.global_rank)

    def barrier(self, name: str | None = None) -> None:
        """Counted first under stage 3, so that a rank running a forward alone raises instead of
        hanging (:class:`~lightning_zero.lockstep.StepLockstep`)."""
        if self._steplock is not None:
            self._steplock.before_barrier()
        super().barrier(name)

    # -- the step methods -----------------------------------------------------------------------------

    def _step_scope(self) -> contextlib.AbstractContextManager[None]:
        """Stage 3: the step may read any parameter (gathered on use, the root unit around it)."""
        return self._engine.step_scope() if self._engine is not None else contextlib.nullcontext()

    def _end_pass(self) -> None:
        if self._engine is not None:
            self._engine.end_pass()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pipeline parallelism: forward and backward of every micro-batch by the schedule
        (ZeRO's reductions complete after each backward), and ``train_<name>`` logged: the true mean
        loss, sent from the last stage. Otherwise the LightningModule's ``training_step``."""
        with self._ddp_forward():
            if not self._parallel.pipelined:
                with self._step_scope():
                    return super().training_step(*args, **kwargs)
            return self._pipeline_train(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._parallel.pipelined:
            return self._pipeline_eval("val", *args, **kwargs)
        try:
            with self._ddp_forward(), self._step_scope():
                return super().validation_step(*args, **kwargs)
        finally:
            self._end_pass()

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._parallel.pipelined:
            return self._pipeline_eval("test", *args, **kwargs)
        try:
            with self._step_scope():
                return super().test_step(*args, **kwargs)
        finally:
            self._end_pass()

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._step_scope():
                return super().predict_step(*args, **kwargs)
        finally:
            self._end_pass()

    # -- DDP's buffer broadcasts around fit's forwards ----------------------------------------------

    def _ddp_forward(self) -> AbstractContextManager:  # broadcast_buffers around what DDP's forward runs in fit
        module = self.lightning_module
        if module is None or module._trainer is None or module.trainer.state.fn != TrainerFn.FITTING:
            return nullcontext()
        manual = not module.automatic_optimization
        return self._buffer_sync.forward(self.config.data_parallel, module, self.data_parallel_group, manual)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            self._buffer_sync.manual_backward()  # DDP's prepare_for_backward

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches: ZeRO's buckets hold them; buffers as under DDP's ``no_sync``."""
        with self._buffer_sync.blocking():
            yield

    # -- pipeline parallelism: the strategy runs the schedule in place of the step hooks ----------

    def _offload_precision(self) -> OffloadPrecision:
        plugin = self.precision_plugin
        assert isinstance(plugin, OffloadPrecision)  # ZeroStrategy's setter converts whatever Lightning assigns
        return plugin

    def _pipeline_train(self, *args: Any, **kwargs: Any) -> Any:
        runner, module, precision = self._parallel.runner, self.lightning_module, self._offload_precision()
        assert runner is not None and module is not None
        accumulate = module.trainer.accumulate_grad_batches if module._trainer is not None else 1
        with precision.train_step_context():
            loss = runner.run(
                args[0],
                train=True,
                scale=1.0 / accumulate,  # the runner weighs each micro-batch by its share of the rows
                scale_loss=lambda t: t * precision.loss_scale,  # no per-micro-batch backward hooks
                after_backward=self._engine.backward_done if self._engine is not None else None,
            )
        assert self._parallel.spec is not None
        module.log(f"train_{self._parallel.spec.name}", loss, prog_bar=True)
        return loss

    def _pipeline_eval(self, prefix: str, *args: Any, **kwargs: Any) -> Any:
        runner, module = self._parallel.runner, self.lightning_module
        assert runner is not None and module is not None and self._parallel.spec is not None
        with self.precision_plugin.val_step_context() if prefix == "val" else self.precision_plugin.test_step_context():
            loss = runner.run(args[0], train=False)
        # Every rank holds its data-parallel shard's loss: the mean over the world is the dp mean.
        module.log(f"{prefix}_{self._parallel.spec.name}", loss, prog_bar=True, sync_dist=True)
        if self._parallel.spec.on_eval is not None:
            self._parallel.spec.on_eval(loss, args[0])
        return loss
