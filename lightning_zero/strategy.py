"""``ZeroStrategy``: ZeRO as a Lightning strategy. Lightning hooks only; the work is in :mod:`lightning_zero.zero`.

Usage::

    import lightning_zero  # registers "zero1", "zero2"
    trainer = Trainer(strategy="zero2", precision="bf16-mixed", devices=8)
    trainer = Trainer(strategy=lightning_zero.ZeroStrategy(stage=1, reduce_bucket_size=50_000_000))

or in a LightningCLI YAML::

    trainer:
      strategy:
        class_path: lightning_zero.ZeroStrategy
        init_args: {stage: 2}

Processes are started the way Lightning starts DDP (its launcher, ``torchrun``, or SLURM). Under
ZeRO, ``param.grad`` is not kept: gradients go straight into reduction buckets; where Lightning
code reads them (``on_before_optimizer_step``, ``configure_gradient_clipping``, after
``manual_backward``, a validation run inside an accumulation window) they are exposed as DDP has
them (``expose_param_grads``, :mod:`lightning_zero.exposure`); :meth:`ZeroStrategy.grad_norm` gives
the global gradient norm without exposing them. Checkpoints are sharded directories that every rank writes in
parallel and that load into any world size or stage (see :mod:`lightning_zero.checkpoint`); plain
(DDP) checkpoint files load too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zero import comm, deepspeed_config, exposure, options, summary
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint import load as ckpt_load
from lightning_zero.checkpoint import rng as ckpt_rng
from lightning_zero.checkpoint import save as ckpt_save
from lightning_zero.checkpoint.module_state import FullStateDictHooks
from lightning_zero.checkpoint.trainer_saves import CheckpointWriting
from lightning_zero.checkpoint.trainer_state import CheckpointState
from lightning_zero.config import (
    PRECISIONS,
    FailureConfig,
    LossScaleConfig,
    PipelineConfig,
    ZeroConfig,
)
from lightning_zero.ddp_args import BufferSync
from lightning_zero.lifecycle import Lifecycle
from lightning_zero.lockstep import StepLockstep, watch_trainer_steps
from lightning_zero.memory import memory_breakdown
from lightning_zero.options import as_offload_precision, new_precision, register_names, strategy_config
from lightning_zero.parallel.setup import ParallelSetup
from lightning_zero.precision import OffloadPrecision
from lightning_zero.sync_batchnorm import zero_layer_sync
from lightning_zero.zero import ZeroEngine, keep_edits_in_masters, shard_averaged_copies

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ZeroStrategy(CheckpointWriting, CheckpointState, DDPStrategy):
    """ZeRO stage 1, 2 or 3 over the data-parallel ranks.

    The ZeRO options (each one a field of the config dataclasses, :data:`lightning_zero.options.OPTIONS`;
    see the Options page) come first under ``Args``, written into this docstring from their fields
    when the module is imported.

    Args:
        loss_scale: dynamic loss-scaling options for "16-mixed".
        config: a DeepSpeed config (a path to its JSON file, or a dict), as Lightning's
            ``DeepSpeedStrategy(config=...)``: each key becomes the option, precision, Trainer check,
            optimizer or scheduler it maps to (:mod:`lightning_zero.deepspeed_config`); an option given
            here with a value other than its default overrides the config's.
        **ddp_kwargs: torch ``DistributedDataParallel``'s other arguments, each accepted with its ZeRO
            meaning or refused with a ValueError (:class:`~lightning_zero.ddp_args.DataParallelConfig`).

    The remaining arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``, ...) are
    those of Lightning's ``DDPStrategy``.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        reduce_bucket_size: int | float | str = "auto",
        allgather_bucket_size: int | float = 50_000_000,
        overlap_comm: bool = True,
        prefetch_bucket_size: int | float | str = 5_000_000,
        param_persistence_threshold: int | float = 100_000,
        max_live_parameters: int | float = 1_000_000_000,
        gather_units: Sequence[type | str] = (),
        allow_untested_optimizer: bool = False,
        on_nonfinite: str = "error",
        absorb_param_edits: bool = True,
        host_mmap_threshold: int | float | None = 1 << 20,
        expose_param_grads: bool | None = None,
        reduce_dtype: str | torch.dtype | None = None,
        offload_optimizer: bool | str = False,
        offload_parameters: bool | str = False,
        pin_memory: bool = True,
        offload_pipeline: bool = True,
        nvme_path: str | None = None,
        nvme_config: dict[str, Any] | None = None,
        loss_scale: LossScaleConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        debug_collectives: bool | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        tensor_parallel_plan: dict[str, str] | None = None,
        pipeline_micro_batches: int | None = None,
        pipeline_schedule: str = "1f1b",
        pipeline_partition: str = "parameters",
        pipeline_chunks: int = 1,
        sequence_parallel: bool = False,
        state_dict_type: str = "sharded",
        activation_checkpointing: Any = None,
        activation_checkpointing_offload: bool = False,
        async_save: bool = False,
        node_local_storage: bool = False,
        config: str | dict[str, Any] | None = None,
        # DDPStrategy's arguments, each with its ZeRO meaning (lightning_zero.ddp_args)
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        arguments = locals()  # the options are ours, by name and default (checked at import, below)
        named = {name: arguments[name] for name in options.STRATEGY_OPTIONS}
        #: The DeepSpeed config (``config=``) read into these options; None without one.
        self.deepspeed, from_deepspeed, loss_scale = deepspeed_config.resolve(config, arguments, strategy_config)
        #: Every option, validated once (sections and the checks across them; shared with Fabric's strategy).
        self.config = from_deepspeed or strategy_config(**named, **ddp_kwargs)
        self._pending_save: ckpt_save.PendingSave | None = None  # an async save not yet published
        self._save_buffer = ckpt_save.HostBuffer()  # an async save's host copy, reused by the next one
        self._deletions: list[threading.Thread] = []  # replaced checkpoints being deleted, joined at teardown
        self._resume_rng: dict[str, Any] | None = None  # random states to restore at the first resumed batch
        self._life = Lifecycle(self.config)  # what a run changes in this process and puts back
        self._loss_scale = loss_scale
        self._engine: ZeroEngine | None = None
        self._state_hooks: FullStateDictHooks | None = None  # the module's own load_state_dict into the shards
        self._steplock: StepLockstep | None = None  # stage 3: a forward some ranks skip raises (lockstep.py)
        self._module_state_out: dict[str, Any] | None = None  # the last lightning_module_state_dict()
        self._buffer_sync = BufferSync()  # broadcast_buffers (DDP's default)
        self._parallel = ParallelSetup(tensor=self.config.tensor, pipeline=self.config.pipeline)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.failure_config.collective_timeout,
            start_method=start_method,
        )

    @property
    def zero_config(self) -> ZeroConfig:
        """The ZeRO options; once the model is set up, with ``"auto"`` sizes resolved for it."""
        return self._engine.config.zero if self._engine is not None else self.config.zero

    @property
    def failure_config(self) -> FailureConfig:
        return self.config.failure

    @property
    def pipeline_config(self) -> PipelineConfig:
        return self.config.pipeline

    # -- precision: always an OffloadPrecision ---------------------------------------------------

    @property
    def precision_plugin(self) -> OffloadPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = self._new_precision("32-true")
        plugin = self._precision_plugin
        assert isinstance(plugin, OffloadPrecision)  # the setter converts whatever Lightning assigns
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = self._as_offload_precision(plugin)

    def _as_offload_precision(self, plugin: Precision | None) -> OffloadPrecision | None:
        """Lightning assigns a generic plugin to a strategy chosen by name: keep its precision string."""
        converted = as_offload_precision(plugin, self.config, self._loss_scale)
        if converted is not None:
            deepspeed_config.check_precision(self.deepspeed, converted.precision)
        return converted

    def _new_precision(self, precision: str) -> OffloadPrecision:
        return new_precision(precision, self.config, self._loss_scale, OffloadPrecision)

    # -- setup and teardown ---------------------------------------------------------------------

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

    def setup_distributed(self) -> None:
        self._life.before_process_group(self._get_process_group_backend())
        super().setup_distributed()
        self._parallel.build_groups(self.world_size, self.root_device.type)
        self._life.after_process_group(self.global_rank, self.world_size, self._parallel.dp_group)

    def on_exception(self, exception: BaseException) -> None:
        """Name the lost rank of a failed collective; add memory and settings to an out-of-memory error."""
        super().on_exception(exception)
        self._life.explain(
            exception,
            rank=self.global_rank,
            world_size=self.world_size,
            engine=self._engine,
            breakdown=self.memory_breakdown,
            registered=list(StrategyRegistry),
            launcher=self.launcher,
        )

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        if trainer.state.fn == TrainerFn.PREDICTING and self._parallel.pipelined:
            raise NotImplementedError(
                "predict under pipeline_parallel_size > 1 is not available: the outputs live on the last stage only; "
                "predict with pipeline_parallel_size=1 (a checkpoint converts to any layout)"
            )
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
            # sync_batchnorm=True as DDPStrategy (reverted by its teardown), before the engine hooks modules
            self._layer_sync = zero_layer_sync(self._layer_sync)
            self.model = self._layer_sync.apply(self.model)
        self._buffer_sync = BufferSync()  # as a freshly wrapped DDP model: broadcast before the first forward
        module = self.lightning_module
        assert module is not None
        stage3 = self.zero_config.stage == 3
        on_meta = self._life.check_meta(module)
        if not on_meta:
            self._parallel.split(module)  # pipeline: only this stage's layers go to the device
            self.model_to_device()
            self._parallel.apply(module, self.root_device)  # before configure_optimizers sees the parameters
        precision = self.precision_plugin
        self._life.prepare(module, precision, self.root_device, self.num_processes)  # after the pipeline split
        config = self._life.engine_config(precision)
        if (fitting := trainer.state.fn == TrainerFn.FITTING) and self.config.checkpoint.state_dict_type != "full":
            # Ranks that cannot see a checkpoint directory are found now, not at the first save (a
            # full checkpoint is written by rank 0 alone, as under DDP: no storage to share).
            ckpt_io.check_shared(
                [d for cb in trainer.checkpoint_callbacks if (d := getattr(cb, "dirpath", None))], None, self._node()
            )
        self._engine = None
        if fitting:
            deepspeed_config.apply_to_trainer(self.deepspeed, trainer)
            self.setup_optimizers(trainer)  # creating an optimizer allocates no state yet
        # configure_optimizers returning None: Lightning steps a _MockOptimizer, which has no parameters
        optimizers = [o for o in self.optimizers if not isinstance(o, _MockOptimizer)] if fitting else []
        if fitting:
            group = self.data_parallel_group
            self._life.check_space(config, module, precision, group, self.num_processes, optimizers)
        if fitting or stage3:
            # Under stage 3 evaluation shards too (a model that needs stage 3 to train needs it to run).
            parallel = self._parallel.context(self.data_parallel_group)
            self._engine = self._life.build_engine(module, optimizers, config, precision, self.root_device, parallel)
        else:
            comm.broadcast_tensors(
                [p.data for p in module.parameters()] + list(module.buffers()), self.data_parallel_group
            )
            self._life.close_recordings()
        engine = self._engine if fitting else None
        move, cast = self.model_to_device, lambda: precision.convert_module(self.model)
        pipelined = self._parallel.pipelined
        self._life.finish(precision, engine, self.root_device, meta=on_meta, move=move, cast=cast, pipelined=pipelined)
        self.setup_precision_plugin()  # re-wraps the optimizers (Lightning's optimizers setter)
        if fitting:
            self._route_lightning_optimizers()
            _optimizers_to_device(self.optimizers, self.root_device)
            exposure.install(trainer, module, self._engine, self.precision_plugin, pipelined=self._parallel.pipelined)
        if self._engine is not None:
            summary.install(trainer, self._engine.held_params(), PRECISIONS[precision.engine_precision][0])
            # Pretrained weights loaded in on_fit_start (after this setup) go into the masters and shards.
            self._state_hooks = FullStateDictHooks(module, self._engine, full_state_dict=False)
            if stage3:  # the EMA/SWA callbacks made their copies (whole) in their setup
                shard_averaged_copies(getattr(trainer, "callbacks", []), module, self._engine)
            if stage3 and not self._parallel.pipelined:  # the pipeline schedule runs forwards outside steps
                group, timeout = self.data_parallel_group, self.failure_config.collective_timeout
                self._steplock = watch_trainer_steps(self._engine, group, timeout)

    def _route_lightning_optimizers(self) -> None:
        """``self.optimizers()`` (manual optimization) returns Lightning's wrappers, whose ``zero_grad``
        is the optimizer class's, not the engine's routed one on the instance: without this,
        ``opt.zero_grad()`` would leave ZeRO-held gradients in place (e.g. the discriminator's from a
        GAN's generator step would add to its next step; tested in test_multiple_optimizers.py)."""
        for wrapper in self._lightning_optimizers:
            routed = wrapper.optimizer.__dict__.get("zero_grad")
            if routed is not None:
                wrapper.zero_grad = routed  # type: ignore[attr-defined]  # shadows the class method

    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            # The end of fit publishes an async save; after a failure only this rank's writer is
            # awaited (committing is a collective a crashed rank would never join): the save stays an
            # unpublished temporary directory, and the previous checkpoint stays in place.
            self._finish_pending_save(abandon=interrupted)
            self._save_buffer = ckpt_save.HostBuffer()  # the host copy is not kept past fit
            while self._deletions:
                self._deletions.pop().join()
        finally:
            self._teardown_engine()

    def _teardown_engine(self) -> None:
        exposure.uninstall(getattr(self.lightning_module, "_trainer", None) if self.lightning_module else None)
        # The engine stays (without its hooks) so that trainer.save_checkpoint() after fit still
        # writes the unsharded optimizer state; the next setup replaces it. Stage 3 parameters become
        # whole again, so the model is usable after fit; not after a failure, because gathering is a
        # collective that a crashed rank would never join.
        if self._state_hooks is not None:
            self._state_hooks.remove()
            self._state_hooks = None
        if self._engine is not None:
            trainer = getattr(self.lightning_module, "_trainer", None)
            finished = trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED
            self._engine.close(unshard=finished)
        self._life.teardown(self.precision_plugin, self.lightning_module, self.root_device)
        super().teardown()

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: ``configure_model`` builds on the meta device, recorded; setup replays it into the
        shards module by module, to the weights the unsharded build gives (``zero/deferred.py``)."""
        if self.zero_config.stage != 3:
            yield
            return
        with self._life.recording(self.root_device):
            yield

    @contextmanager
    def gathered_parameters(
        self, module: torch.nn.Module | None = None, modifier_rank: int | None = None
    ) -> Generator[None, None, None]:
        """Inside the block, ``module`` (default: the LightningModule) has its full parameters on every
        rank, under stage 3 too. Edits made on rank ``modifier_rank`` (e.g. loading pretrained
        weights there) are written back into every rank's shards and fp32 masters. Call on all ranks."""
        if self._engine is None:
            yield
            return
        module = module or self.lightning_module
        assert module is not None
        with self._engine.gathered_parameters(module, modifier_rank):
            yield

    def barrier(self, name: str | None = None) -> None:
        """Counted first under stage 3, so that a rank running a forward alone raises instead of
        hanging (:class:`~lightning_zero.lockstep.StepLockstep`)."""
        if self._steplock is not None:
            self._steplock.before_barrier()
        super().barrier(name)

    def _step_scope(self) -> contextlib.AbstractContextManager[None]:
        """Stage 3: the step may read any parameter (gathered on use, the root unit around it)."""
        return self._engine.step_scope() if self._engine is not None else contextlib.nullcontext()

    def _end_pass(self) -> None:
        if self._engine is not None:
            self._engine.end_pass()

    def on_train_end(self) -> None:
        # after the callbacks' on_train_end (Lightning calls the strategy's last)
        if self._engine is not None:
            keep_edits_in_masters(self._engine)
        super().on_train_end()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._end_pass()
        if self._engine is not None:
            self._engine.add_param_groups()  # groups added by callbacks at epoch start (BackboneFinetuning)
        if (
            self.config.checkpoint.async_save
            and not self._save_buffer.reserved
            and self._engine is not None
            and self.lightning_module is not None
            and self.lightning_module.trainer.global_step > 0
        ):
            # after the first optimizer step (the states exist): the host copy's memory, allocated in a thread
            ckpt_save.reserve_host_buffer(self._save_buffer, self.lightning_module, self._engine, self.optimizers)
        if self._pending_save is not None:
            # A step boundary (every rank passes it alike): publish the async save if every rank's
            # writer has finished, raising a writer's failure on every rank; one small all-gather.
            pending, self._pending_save = self._pending_save, None
            if not ckpt_save.poll_save(pending):
                self._pending_save = pending
        super().on_train_batch_start(batch, batch_idx)

    def connect(self, model: pl.LightningModule) -> None:
        """Before Lightning checks the module: a DeepSpeed config's optimizer becomes its configure_optimizers."""
        deepspeed_config.install_optimizers(self.deepspeed, model)
        super().connect(model)

    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            dp = trainer.world_size // (self.config.tensor.size * self.config.pipeline.stages)
            deepspeed_config.check_batch(self.deepspeed, trainer, dp)
        if self._resume_rng is not None and trainer is not None and trainer.fit_loop.restarted_mid_epoch:
            # A mid-epoch resume has just created its train loader's iterator (drawing a base seed from the
            # random states the checkpoint restored), which the uninterrupted run did not do at that point:
            # the states are restored again, so the rest of the epoch draws what that run drew. (After an
            # epoch-end save both runs create an iterator first: nothing to undo then.)
            ckpt_rng.restore(self._resume_rng)
        self._resume_rng = None
        module = self.lightning_module
        if module is not None and self._engine is not None and self.zero_config.stage == 3:
            # an AveragedModel a callback made from the sharded model (on_fit_start, on_train_start)
            shard_averaged_copies(getattr(trainer, "callbacks", []), module, self._engine)
        super().on_train_start()

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

    # -- pipeline parallelism: the strategy runs the schedule in place of the step hooks ----------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pipeline parallelism: forward and backward of every micro-batch by the schedule
        (ZeRO's reductions complete after each backward), and ``train_<name>`` logged: the true mean
        loss, sent from the last stage. Otherwise the LightningModule's ``training_step``."""
        with self._ddp_forward():
            if not self._parallel.pipelined:
                with self._step_scope():
                    return super().training_step(*args, **kwargs)
            return self._pipeline_train(*args, **kwargs)

    def _pipeline_train(self, *args: Any, **kwargs: Any) -> Any:
        runner, module, precision = self._parallel.runner, self.lightning_module, self.precision_plugin
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

    # -- training hooks ---------------------------------------------------------------------------

    def grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Global L2 norm of the reduced, unscaled gradients (valid after the last backward of an
        accumulation window until the step: in ``on_before_optimizer_step``, or before
        ``optimizer.step()`` in manual optimization). Call on all ranks."""
        if self._engine is None:
            raise RuntimeError("grad_norm() is only available while fitting.")
        return self._engine.grad_norm(optimizer, 1.0 / self.precision_plugin.loss_scale)

    @contextmanager
    def full_gradients(self, module: torch.nn.Module | None = None) -> Generator[None, None, None]:
        """Inside the block the trainable parameters of ``module`` (default: the LightningModule) have
        ``.grad`` as under DDP: the full reduced, unscaled gradients of the window (stage 3 gathers
        the parameters too), so Lightning's ``grad_norm(module, norm_type)`` utility and code that
        reads ``param.grad`` work. Valid where :meth:`grad_norm` is (``on_before_optimizer_step``, or
        before ``optimizer.step()`` in manual optimization). Costs one all-gather of the gradients
        and their full size in memory while inside. Call on all ranks."""
        if self._engine is None:
            raise RuntimeError("full_gradients() is only available while fitting.")
        module = module or self.lightning_module
        assert module is not None
        with self._engine.full_gradients(module, 1.0 / self.precision_plugin.loss_scale):
            yield

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by category (see :func:`lightning_zero.memory.memory_breakdown`)."""
        assert self.lightning_module is not None
        return memory_breakdown(self.lightning_module, self._engine, self.root_device)

    # -- checkpoints: sharded directories (lightning_zero.checkpoint) -----------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Checkpoints load into the engine's slices, so after setup has built the engine (stage 3
        # models may not even exist whole before that), each rank reading only its pieces. Lightning
        # then restores the callbacks after their on_fit_start (as under FSDP and DeepSpeed): see
        # checkpoint.load.replay_callback_restores for the one that acts there on its restored state.
        return True

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """For a ZeRO optimizer only its parameter groups (the states go into the rank files)."""
        if self._engine is None or not self._engine.manages(optimizer):
            return super().optimizer_state(optimizer)
        assert self.lightning_module is not None
        return ckpt_save.optimizer_groups(self.lightning_module, self._engine, optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory, or a plain Lightning checkpoint file (DDP, single device)."""
        self._finish_pending_save()
        plain = super().load_checkpoint
        checkpoint = ckpt_load.load_checkpoint(
            checkpoint_path, weights_only, self.global_rank, lambda p: plain(str(p), weights_only)
        )
        self._resume_rng = checkpoint.get(ckpt_load.RESUME_KEY, {}).get("rng")
        return checkpoint

    # -- registration -------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)


#: The Trainer strategy's arguments that are not ZeRO options: Lightning's ``DDPStrategy``'s, the loss
#: scale (the precision plugin's) and a DeepSpeed config.
LIGHTNING_ARGUMENTS = (
    "loss_scale",
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "start_method",
    "config",
)
# The signature stays explicit (LightningCLI and jsonargparse read it); it must be the options' own.
options.check_signature(ZeroStrategy.__init__, LIGHTNING_ARGUMENTS)
ZeroStrategy.__doc__ = options.document(ZeroStrategy.__doc__)
