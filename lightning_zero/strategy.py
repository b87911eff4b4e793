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
ZeRO, ``param.grad`` is not kept: gradients go straight into reduction buckets, so
``on_before_optimizer_step`` hooks see ``None`` gradients; use :meth:`ZeroStrategy.grad_norm`
for the global gradient norm. Checkpoints written by Lightning hold the full model and an unsharded
optimizer state, so plain (DDP) and ZeRO checkpoints load into each other.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generator, Literal, Mapping, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_zero import comm
from lightning_zero.config import LossScaleConfig, ZeroConfig, normalize_precision
from lightning_zero.memory import memory_breakdown
from lightning_zero.precision import OffloadPrecision
from lightning_zero.zero.engine import ZeroEngine

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ZeroStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 over the data-parallel ranks.

    Args:
        stage: 1 shards fp32 master weights and optimizer states; 2 also shards gradients.
        reduce_bucket_size: elements per gradient bucket (one flat buffer, one reduce-scatter).
        allgather_bucket_size: most elements of parameter all-gathers in flight after a step.
        overlap_comm: reduce buckets during backward as they fill (False: after backward).
        allow_untested_optimizer: accept an optimizer not known to be elementwise (see
            :func:`lightning_zero.zero.optimizer.check_optimizer`).
        loss_scale: dynamic loss-scaling options for "16-mixed".
        The remaining arguments are those of Lightning's ``DDPStrategy``.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 2,
        reduce_bucket_size: int = 25_000_000,
        allgather_bucket_size: int = 50_000_000,
        overlap_comm: bool = True,
        allow_untested_optimizer: bool = False,
        loss_scale: Optional[LossScaleConfig] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.zero_config = ZeroConfig(
            stage=stage,
            reduce_bucket_size=reduce_bucket_size,
            allgather_bucket_size=allgather_bucket_size,
            overlap_comm=overlap_comm,
            allow_untested_optimizer=allow_untested_optimizer,
        )
        self._loss_scale = loss_scale
        self._engine: Optional[ZeroEngine] = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    # -- precision: always an OffloadPrecision ---------------------------------------------------

    @property
    def precision_plugin(self) -> OffloadPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = OffloadPrecision("32-true", self._loss_scale)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = self._as_offload_precision(plugin)

    def _as_offload_precision(self, plugin: Optional[Precision]) -> Optional[OffloadPrecision]:
        """Lightning assigns a generic plugin to a strategy chosen by name: keep its precision string."""
        if plugin is None or isinstance(plugin, OffloadPrecision):
            return plugin
        # (A plugin given to the strategy itself reaches here unchanged: Lightning prefers it to the
        # Trainer's precision flag.)
        requested = normalize_precision(getattr(plugin, "precision", "32-true"))
        return OffloadPrecision(requested, self._loss_scale)

    # -- setup and teardown ---------------------------------------------------------------------

    @property
    def data_parallel_group(self) -> comm.ProcessGroup:
        """The group ZeRO shards over (the default group: data parallelism only)."""
        return None

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        precision = self.precision_plugin
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._engine = None
        if fitting:
            self.setup_optimizers(trainer)
            self._engine = ZeroEngine(
                self.lightning_module,
                self.optimizers,
                self.zero_config,
                precision.compute_dtype,
                precision.separate_master,
                self.data_parallel_group,
                self.root_device,
            )
        else:
            module = self.lightning_module
            comm.broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), self.data_parallel_group)
        precision.convert_module(self.model)
        precision.attach(self._engine, self.root_device)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def teardown(self) -> None:
        # The engine stays (without its hooks) so that trainer.save_checkpoint() after fit still
        # writes the unsharded optimizer state; the next setup replaces it.
        if self._engine is not None:
            self._engine.close()
        self.precision_plugin.attach(None, self.root_device)
        super().teardown()

    # -- training hooks ---------------------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for micro-steps before the accumulation boundary."""
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    def grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Global L2 norm of the reduced, unscaled gradients (valid from ``on_before_optimizer_step``
        until the step). Call on all ranks."""
        if self._engine is None:
            raise RuntimeError("grad_norm() is only available while fitting.")
        return self._engine.grad_norm(optimizer)

    def memory_breakdown(self) -> dict[str, dict[str, int]]:
        """This rank's bytes by category (see :func:`lightning_zero.memory.memory_breakdown`)."""
        assert self.lightning_module is not None
        return memory_breakdown(self.lightning_module, self._engine, self.root_device)

    # -- checkpoints ------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Unsharded optimizer state on rank 0 (``{}`` elsewhere). Called on all ranks."""
        if self._engine is None or self._engine.find(optimizer) is None:
            return super().optimizer_state(optimizer)
        return self._engine.optimizer_state_dict(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint has {len(states)} optimizer states but configure_optimizers returned "
                f"{len(self.optimizers)} optimizers."
            )
        for optimizer, state in zip(self.optimizers, states):
            if self._engine is not None and self._engine.find(optimizer) is not None:
                self._engine.load_optimizer_state_dict(optimizer, state)
            else:
                optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)

    # -- registration -------------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for stage in (1, 2):
            strategy_registry.register(
                f"zero{stage}",
                cls,
                description=f"lightning_zero ZeRO stage {stage}",
                override=True,
                stage=stage,
            )

