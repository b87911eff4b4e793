"""``ZeroStrategy`` for Lightning Fabric: the same engine, options and checkpoint format as the Trainer's.

Usage::

    import lightning_zero  # registers "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload" with Fabric too
    fabric = Fabric(strategy="zero3", precision="bf16-mixed", devices=8)
    fabric = Fabric(strategy=lightning_zero.fabric.ZeroStrategy(stage=2, reduce_bucket_size=50_000_000))
    fabric.launch()
    with fabric.init_module():               # stage 3: built straight into each rank's shards
        model = MyModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    for i, batch in enumerate(loader):
        loss = model(batch)
        fabric.backward(loss / accumulate)   # reduces into this rank's gradient shard
        if (i + 1) % accumulate == 0:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)  # global norm over the shards
            optimizer.step()                 # this rank's slices, then publish
            optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": i})  # a sharded directory

The strategy drives the one :class:`~lightning_zero.zero.engine.ZeroEngine` exactly as the Trainer
strategy does (its options are :func:`lightning_zero.options.strategy_config`'s, and the loss scale and
non-finite policy step through :meth:`lightning_zero.OffloadPrecision.zero_step`):
``fabric.backward`` scales the loss ("16-mixed"), runs backward (the engine's hooks reduce the gradients
into buckets) and completes the reductions; ``optimizer.step()`` exposes this rank's unscaled slices,
steps them and publishes. What differs from the Trainer:

* The engine is built for the model and all its optimizers at once: ``fabric.setup(model, opt1, opt2)``,
  or ``fabric.setup_module(model)`` then ``fabric.setup_optimizers(opt1, opt2)``: Fabric hands those
  over one at a time, and each after the first (and at stage 3 the first too, when ``setup_module``
  already sharded the model) rebuilds the engine for all of them from the weights it holds (the whole
  model on every rank for the moment of the rebuild), until the first step.
* Stage 3 ``init_module``: what the program does to the meta model between the block and ``setup``
  (``reset_parameters()``, an init loop) is recorded too (:class:`~lightning_zero.zero.deferred.Continuation`).
* ``fabric.no_backward_sync`` is accepted and changes nothing: ZeRO accumulates the window in its own
  buffers (stage 1 reduces once, at the step; stages 2 and 3 reduce-scatter each micro-batch into the
  gradient shard, which is what keeps their gradients sharded), so there is no synchronization to skip.
* ``param.grad`` stays ``None`` (gradients go straight into the buckets); ``fabric.clip_gradients``
  clips over the shards (``max_norm`` with the L2 norm only, or ``clip_val``).
* ``optimizer.step()`` drops the window's gradients; ``optimizer.zero_grad()`` after it has nothing left
  to drop. To discard gradients in the middle of a window call ``fabric.strategy.zero_grad(optimizer)``
  (Fabric's optimizer wrapper calls the optimizer class's ``zero_grad``, not the engine's).
* Data parallelism only: tensor and pipeline parallelism are the Trainer strategy's (they need the
  LightningModule's plan and ``configure_pipeline``).
* ``fabric.save(path, state)`` writes the Trainer strategy's sharded directory: the model's weights
  under ``state_dict``, the optimizers and LR schedulers (in the order of ``state``) under
  ``optimizer_states`` and ``lr_schedulers``, the loss scaler under ``OffloadPrecision``, everything
  else as given. A Trainer checkpoint loads with ``fabric.load(path, {"model": model, "optimizer":
  optimizer})`` (the rest comes back, e.g. ``global_step``), and a Fabric one resumes a Trainer
  through ``ckpt_path=`` (use the same module class, so that the parameter names match; the Trainer's
  loop counters start from 0). A plain Fabric DDP checkpoint file loads too. Any world size and stage
  load, as for the Trainer. ``filter=`` is refused (the format holds every piece of every rank). Any
  part of the state may be saved and loaded: the model alone, the optimizers alone (the weights are
  stored with them), plain values. ``state_dict_type="full"`` writes one file from rank 0 instead,
  ``{"model": whole state dict, "optimizer": its own state_dict, ...}`` under the state's keys, as
  Fabric's DDP and FSDP (full) write it, which ``torch.load`` reads.
* The set-up model's own ``load_state_dict`` takes a full state dict at every stage (each rank keeps
  its piece, in its fp32 master), and under stage 3 its ``state_dict()`` is a full one, gathered on
  every rank (a collective), as FSDP's (:mod:`lightning_zero.checkpoint.module_state`).
* Stage 3: a forward that only some ranks run while the others wait at ``fabric.barrier()`` raises,
  naming the model, instead of hanging (:mod:`lightning_zero.lockstep`).
* Stage 3 evaluation: a forward without backward (under ``torch.no_grad()``) ends its pass at the
  model's forward hook (the Trainer ends it after ``validation_step``).

The strategy's setup calls are its mixin :class:`~lightning_zero.fabric_setup.FabricSetup`'s, and
``fabric.save`` / ``fabric.load`` its mixin :class:`~lightning_zero.checkpoint.fabric_saves.FabricCheckpoints`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.utilities.init import _EmptyInit
from torch import nn

from lightning_zero import comm, deepspeed_config
from lightning_zero.checkpoint.fabric_saves import FabricCheckpoints
from lightning_zero.checkpoint.module_state import FullStateDictHooks
from lightning_zero.config import LossScaleConfig
from lightning_zero.ddp_args import BufferSync
from lightning_zero.fabric_plugins import FabricOffloadPrecision, ZeroBackwardSync, explained
from lightning_zero.fabric_setup import FabricSetup
from lightning_zero.lifecycle import Lifecycle
from lightning_zero.lockstep import Lockstep
from lightning_zero.memory import memory_breakdown
from lightning_zero.options import (
    STRATEGY_OPTIONS,
    check_signature,
    new_precision,
    register_names,
    strategy_config,
    strategy_precision,
)
from lightning_zero.zero import Continuation, ZeroEngine


# (mypy: setup_module returns the model itself, where Fabric's DDPStrategy returns its DDP wrapper)
class FabricZeroStrategy(FabricCheckpoints, FabricSetup, DDPStrategy):  # type: ignore[misc]
    """ZeRO stage 1, 2 or 3 over Fabric's ranks (also importable as ``lightning_zero.fabric.ZeroStrategy``).

    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision``,
    ``process_group_backend`` and ``start_method`` are as for Fabric's ``DDPStrategy``.

    Args:
        stage: 1 shards fp32 master weights and optimizer states; 2 also gradients; 3 also parameters.
        loss_scale: dynamic loss-scaling options for "16-mixed".
        **options: the other options of :class:`lightning_zero.ZeroStrategy` (``reduce_bucket_size``,
            ``offload_optimizer``, ``offload_parameters``, ``activation_checkpointing``, ``timeout``, ...),
            with the same meaning and defaults (:func:`lightning_zero.options.strategy_config`).
        config: a DeepSpeed config (a path to its JSON file, or a dict), as for the Trainer strategy; its
            optimizer, scheduler and gradient_clipping are refused (your loop owns them; see
            :func:`lightning_zero.deepspeed_config.check_fabric`).

    Raises:
        ValueError: for an invalid option, for ``tensor_parallel_size`` or ``pipeline_parallel_size``
            above 1, ``async_save=True`` or ``node_local_storage=True`` (the Trainer strategy's).
        TypeError: for an unknown option.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        *,
        loss_scale: LossScaleConfig | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        config: str | dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        # names that are not options go to DataParallelConfig: torch DDP's arguments (an unknown name is
        # a TypeError there, as DDP's)
        extra = {name: value for name, value in options.items() if name not in STRATEGY_OPTIONS}
        given = {"stage": stage, "loss_scale": loss_scale, **options, "ddp_kwargs": extra}
        #: The DeepSpeed config (``config=``) read into these options; None without one.
        self.deepspeed, from_deepspeed, loss_scale = deepspeed_config.resolve(config, given, strategy_config)
        deepspeed_config.check_fabric(self.deepspeed)
        #: Every option, validated once, as for the Trainer strategy.
        self.config = from_deepspeed or strategy_config(stage=stage, **options)
        if self.config.tensor.size > 1 or self.config.pipeline.stages > 1:
            raise ValueError(
                f"tensor_parallel_size={self.config.tensor.size}, pipeline_parallel_size={self.config.pipeline.stages}:"
                " Fabric's ZeroStrategy is data parallel only; tensor and pipeline parallelism need the Trainer's "
                "lightning_zero.ZeroStrategy (a LightningModule's plan and configure_pipeline)."
            )
        ckpt = self.config.checkpoint
        if ckpt.async_save or ckpt.node_local_storage:
            raise ValueError(
                f"async_save={ckpt.async_save}, node_local_storage={ckpt.node_local_storage}: Fabric's ZeroStrategy "
                "writes checkpoints synchronously into one shared place (no step boundary of a Trainer publishes an "
                "async save); leave both at their defaults."
            )
        self._loss_scale = loss_scale
        self._engine: ZeroEngine | None = None
        self._module: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._life = Lifecycle(self.config, "fabric")  # what a run changes in this process and puts back
        self._continuation: Continuation | None = None  # recording what runs on the meta model until setup
        self._deferred = False  # stage 3 setup_module: the engine waits for setup_optimizers (or a use)
        self._state_hooks: FullStateDictHooks | None = None  # model.load_state_dict / state_dict, full
        self._lockstep: Lockstep | None = None  # stage 3: a forward some ranks skip raises (lockstep.py)
        self._watch_hook: Any = None
        self._eval_hook: Any = None  # stage 3: ends a forward-only pass (no backward ends it)
        self._buffers_hooks: list[Any] = []  # broadcast_buffers: around the model's forward, as DDP's
        self._steps = 0  # optimizer steps taken, for the messages
        self._optimizer_states_loaded = False  # then setup_optimizers can no longer rebuild the engine
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=self.config.failure.collective_timeout,
            start_method=start_method,
        )
        self._buffer_sync = BufferSync()  # broadcast_buffers (DDP's default)
        self._backward_sync_control = ZeroBackwardSync(self._buffer_sync)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(strategy_registry, cls)

    # -- precision: always a FabricOffloadPrecision -------------------------------------------------

    @property
    def precision(self) -> FabricOffloadPrecision:
        if self._precision is None:
            self._precision = new_precision("32-true", self.config, self._loss_scale, FabricOffloadPrecision)
        assert isinstance(self._precision, FabricOffloadPrecision)  # the setter converts what Fabric assigns
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        cls = FabricOffloadPrecision
        self._precision = strategy_precision(precision, self.config, self._loss_scale, self.deepspeed, cls)

    # -- processes ----------------------------------------------------------------------------------

    @property
    def data_parallel_group(self) -> comm.ProcessGroup:
        """The group ZeRO shards over (the default group; checked when ``debug_collectives`` is on)."""
        return self._life.checked_group

    def _setup_distributed(self) -> None:
        self._life.before_process_group(self._get_process_group_backend())
        super()._setup_distributed()
        self._life.after_process_group(self.global_rank, self.world_size, None)

    @contextmanager
    def _explaining(self) -> Generator[None, None, None]:
        """Around what Fabric calls that communicates (setup, forward, backward, step, clipping, barrier,
        save, load): a failed collective names the lost rank, an out-of-memory error gets this rank's
        memory, as the Trainer strategy's ``on_exception`` does (:meth:`lightning_zero.lifecycle.Lifecycle.explain`)."""
        try:
            yield
        except Exception as error:
            self._life.explain(
                error,
                rank=self.global_rank,
                world_size=self.world_size,
                engine=self._engine,
                breakdown=self.memory_breakdown,
                registered=list(STRATEGY_REGISTRY),
                launcher=self.launcher,
            )
            raise

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by category (see :func:`lightning_zero.memory.memory_breakdown`)."""
        return memory_breakdown(self._saved_module(), self._engine, self.root_device)

    # -- the model before setup (setup itself: fabric_setup.FabricSetup) ------------------------------

    @contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``fabric.init_module()``. Stage 3: the model is built on the meta device and recorded;
        ``fabric.setup`` replays it into each rank's shards, to the values an unsharded build with the
        same seed gives (:mod:`lightning_zero.zero.deferred`). Otherwise Fabric's own."""
        if self.config.zero.stage != 3:
            with super().module_init_context(empty_init):
                yield
            return
        self._end_continuation()
        skip = bool(empty_init)  # torch.nn.init does nothing, as under Fabric's DDP and FSDP
        with (
            self.precision.module_init_context(),
            _EmptyInit(enabled=skip),
            self._life.recording(self.root_device, skip) as rec,
        ):
            yield
        # what the program does to the meta model before setup (reset_parameters(), an init loop) is
        # part of its build: recorded too (Continuation), until setup ends it
        self._continuation = Continuation(rec).start()

    def _end_continuation(self) -> None:
        if self._continuation is not None:
            self._continuation.end()
            self._continuation = None

    @explained
    def barrier(self, name: str | None = None) -> None:
        """``fabric.barrier()``; under stage 3 through the store, raising when another rank runs a
        forward this rank does not (:mod:`lightning_zero.lockstep`) instead of hanging."""
        if self._lockstep is None or self._module is None:
            super().barrier(name)
            return
        self._lockstep.barrier(type(self._module).__name__)

    def _training_engine(self, what: str) -> ZeroEngine:
        if self._engine is None or not self._optimizers:
            raise ValueError(
                f"{what} under ZeRO stage {self.config.zero.stage} needs the optimizer set up with the model "
                f"(its gradients go into the optimizer's shards); call fabric.setup(model, optimizer), or "
                "fabric.setup_optimizers(optimizer) after fabric.setup_module(model) (stages 1 and 2)."
            )
        return self._engine

    # -- backward and step ---------------------------------------------------------------------------

    @explained
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Scale ("16-mixed"), backward (the engine's hooks reduce into buckets), complete the reductions."""
        engine = self._training_engine("fabric.backward()")
        precision = self.precision
        scaled = tensor * precision.loss_scale if precision.scaler is not None else tensor
        scaled.backward(*args, **kwargs)
        engine.backward_done()

    @explained
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``: this rank's slices (unscaled), then publish; the gradients are dropped."""
        if self._engine is None or not self._engine.manages(optimizer):
            return super().optimizer_step(optimizer, **kwargs)
        closure: Callable[[], Any] | None = kwargs.pop("closure", None)
        if closure is not None and self._engine.replicates(optimizer):
            # a whole-model optimizer (LBFGS) evaluates the closure itself, several times
            result = self.precision.zero_step(optimizer, step=self._steps, step_kwargs=kwargs, closure=closure)
            self._steps += 1
            return result
        result = closure() if closure is not None else None
        self.precision.zero_step(optimizer, step=self._steps)
        self._steps += 1
        return result

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop every gradient of ``optimizer`` since its last step (ZeRO-held ones too). Call on all ranks."""
        self._training_engine("zero_grad()").zero_grad(optimizer)

    @explained
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip to a global L2 norm over the shards, as DDP clips the full gradients; returns the norm
        before clipping. Call on all ranks, after the window's last backward."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"fabric.clip_gradients(norm_type={norm_type}): ZeRO clips by the global L2 norm over the shards; "
                "use norm_type=2.0, or clip_val= to clip by value."
            )
        engine = self._training_engine("fabric.clip_gradients()")
        precision = self.precision
        norm = engine.clip_grad_norm(optimizer, float(max_norm), 1.0 / precision.loss_scale)
        # "16-mixed" overflows are expected: the step skips them. Otherwise as torch's clip_grad_norm_.
        if error_if_nonfinite and precision.scaler is None and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"the total norm of order 2.0 of the gradients is non-finite ({float(norm)}), so it cannot be "
                "clipped; pass error_if_nonfinite=False to clip anyway (the step then follows on_nonfinite)."
            )
        return norm

    @explained
    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient element of this rank's slices to ``[-clip_val, clip_val]``."""
        engine = self._training_engine("fabric.clip_gradients()")
        engine.clip_grad_value(optimizer, float(clip_val), 1.0 / self.precision.loss_scale)

    @contextmanager
    def gathered_parameters(
        self, module: nn.Module | None = None, modifier_rank: int | None = None
    ) -> Generator[None, None, None]:
        """Inside the block ``module`` (default: the model) has its full parameters on every rank, under
        stage 3 too; edits on ``modifier_rank`` are written back into every rank's shards and fp32
        masters. Call on all ranks."""
        self._ensure_built()
        module = module or self._module
        if self._engine is None or module is None:
            yield
            return
        if self._lockstep is not None:
            self._lockstep.paused += 1  # a forward in here gathers nothing: one rank alone may run it
        try:
            with self._explaining(), self._engine.gathered_parameters(module, modifier_rank):
                yield
        finally:
            if self._lockstep is not None:
                self._lockstep.paused -= 1

    # -- teardown ----------------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Remove the engine's hooks; stage 3 parameters become whole again (a collective), unless
        nvme ``restore_after_fit`` resolves to False (the default with parameters on disk)."""
        self._end_continuation()
        self._remove_hooks()
        if self._engine is not None:
            self._engine.close(unshard=True)
            self._engine = None
        self._life.teardown(self.precision, self._module, self.root_device)
        super().teardown()


# Fabric's own arguments; the options come as keywords (``stage`` explicitly), checked against the table.
check_signature(
    FabricZeroStrategy.__init__,
    ("loss_scale", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision")
    + ("process_group_backend", "start_method", "config"),
    every_option=False,
)

#: The name users write (``lightning_zero.fabric.ZeroStrategy``), kept for the class of Fabric's API; tracebacks
#: and ``type(strategy).__name__`` say ``FabricZeroStrategy``, the Trainer's is ``lightning_zero.ZeroStrategy``.
ZeroStrategy = FabricZeroStrategy

__all__ = ["FabricOffloadPrecision", "FabricZeroStrategy", "ZeroStrategy"]
