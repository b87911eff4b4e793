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

This file holds construction, setup and teardown (over :class:`~lightning_zero.lifecycle.Lifecycle`,
shared with Fabric's strategy) and the public calls; the hooks of every step and the process groups
are its base class's (:mod:`lightning_zero.trainer_steps`), checkpoint writing and the states in a
checkpoint its mixins' (:mod:`lightning_zero.checkpoint.trainer_saves`,
:mod:`lightning_zero.checkpoint.trainer_state`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zero import comm, deepspeed_config, exposure, options, summary
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint import load as ckpt_load
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
from lightning_zero.options import new_precision, register_names, strategy_config, strategy_precision
from lightning_zero.parallel.setup import ParallelSetup
from lightning_zero.precision import OffloadPrecision
from lightning_zero.sync_batchnorm import zero_layer_sync
from lightning_zero.trainer_steps import TrainerSteps
from lightning_zero.zero import ZeroEngine, keep_edits_in_masters, shard_averaged_copies

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ZeroStrategy(CheckpointWriting, CheckpointState, TrainerSteps):
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
        self._life = Lifecycle(self.config, "trainer")  # what a run changes in this process and puts back
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
            self._precision_plugin = new_precision("32-true", self.config, self._loss_scale, OffloadPrecision)
        plugin = self._precision_plugin
        assert isinstance(plugin, OffloadPrecision)  # the setter converts whatever Lightning assigns
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning assigns a generic plugin to a strategy chosen by name: its precision string is kept
        self._precision_plugin = strategy_precision(plugin, self.config, self._loss_scale, self.deepspeed)

    # -- setup and teardown ---------------------------------------------------------------------

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
        move, cast = self.model_to_device, lambda: precision.convert_module(self.model)
        device, processes, pipelined = self.root_device, self.num_processes, self._parallel.pipelined
        if fitting or stage3:
            # Under stage 3 evaluation shards too (a model that needs stage 3 to train needs it to run).
            parallel = self._parallel.context(self.data_parallel_group)
            self._engine = self._life.build(
                module,
                optimizers,
                precision,
                device,
                parallel,
                processes=processes,
                training=fitting,
                move=move,
                cast=cast,
                pipelined=pipelined,
            )
        else:  # evaluation at stage 1/2: the whole model on every rank, as under DDP
            self._life.prepare(module, precision, device, processes)
            comm.broadcast_tensors(
                [p.data for p in module.parameters()] + list(module.buffers()), self.data_parallel_group
            )
            self._life.close_recordings()
            self._life.finish(precision, None, device, meta=on_meta, move=move, cast=cast, pipelined=pipelined)
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
            self._finish_saves(interrupted)  # publish an async save (CheckpointWriting)
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

    def on_train_end(self) -> None:
        # after the callbacks' on_train_end (Lightning calls the strategy's last)
        if self._engine is not None:
            keep_edits_in_masters(self._engine)
        super().on_train_end()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._end_pass()
        if self._engine is not None:
            self._engine.add_param_groups()  # groups added by callbacks at epoch start (BackboneFinetuning)
        self._async_save_at_step_boundary()  # CheckpointWriting
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
        self._restore_resume_rng(trainer)  # CheckpointState: a mid-epoch resume's random states
        module = self.lightning_module
        if module is not None and self._engine is not None and self.zero_config.stage == 3:
            # an AveragedModel a callback made from the sharded model (on_fit_start, on_train_start)
            shard_averaged_copies(getattr(trainer, "callbacks", []), module, self._engine)
        super().on_train_start()

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
