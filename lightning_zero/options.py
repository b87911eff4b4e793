"""What the Trainer and Fabric strategies share before any process exists: their options and their precision.

:class:`lightning_zero.ZeroStrategy` (Trainer) and :class:`lightning_zero.fabric.FabricZeroStrategy` (Fabric)
take the same ZeRO options; :func:`strategy_config` turns them into the one validated
:class:`~lightning_zero.config.StrategyConfig` (its signature is the list of options and their
defaults, documented on the Trainer strategy). :func:`as_offload_precision` converts whatever
precision plugin Lightning or Fabric assigns a strategy chosen by name into an
:class:`~lightning_zero.OffloadPrecision` with the same precision string.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision

from lightning_zero import debug
from lightning_zero.config import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    FailureConfig,
    LossScaleConfig,
    OffloadConfig,
    PipelineConfig,
    StrategyConfig,
    TensorParallelConfig,
    ZeroConfig,
    normalize_precision,
)
from lightning_zero.config import nvme_config as nvme_config_from
from lightning_zero.ddp_args import DataParallelConfig
from lightning_zero.precision import OffloadPrecision


def strategy_config(
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
    timeout: timedelta | float | None = None,
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
) -> StrategyConfig:
    """Every ZeRO option of a strategy, validated once (``ValueError`` naming the bad value and the fix).

    The arguments are those of :class:`lightning_zero.ZeroStrategy` (see its docstring) without
    Lightning's own (accelerator, devices, cluster environment, precision plugin, ...) and ``loss_scale``
    (which belongs to the precision plugin). ``ddp_kwargs``: the other keyword arguments of torch's
    ``DistributedDataParallel`` (:class:`~lightning_zero.ddp_args.DataParallelConfig`).
    """
    # sizes in elements or bytes: integral floats (5e8) are taken as integers by ZeroConfig
    sizes: dict[str, Any] = dict(
        reduce_bucket_size=reduce_bucket_size,
        allgather_bucket_size=allgather_bucket_size,
        prefetch_bucket_size=prefetch_bucket_size,
        param_persistence_threshold=param_persistence_threshold,
        max_live_parameters=max_live_parameters,
        host_mmap_threshold=host_mmap_threshold,
    )
    return StrategyConfig(
        zero=ZeroConfig(
            stage=stage,
            overlap_comm=overlap_comm,
            gather_units=tuple(gather_units),
            allow_untested_optimizer=allow_untested_optimizer,
            on_nonfinite=on_nonfinite,
            absorb_param_edits=absorb_param_edits,
            expose_param_grads=expose_param_grads,
            reduce_dtype=reduce_dtype,
            **sizes,
        ),
        offload=OffloadConfig(
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            pin_memory=pin_memory,
            pipeline=offload_pipeline,
            nvme=nvme_config_from(None if nvme_path is None else str(nvme_path), nvme_config),
        ),
        tensor=TensorParallelConfig(
            size=tensor_parallel_size, plan=tensor_parallel_plan, sequence_parallel=sequence_parallel
        ),
        pipeline=PipelineConfig(
            stages=pipeline_parallel_size,
            micro_batches=pipeline_micro_batches,
            schedule=pipeline_schedule,
            partition=pipeline_partition,
            chunks=pipeline_chunks,
        ),
        failure=FailureConfig(
            **({} if timeout is None else {"timeout": timeout}),
            debug_collectives=debug.debug_from_env() if debug_collectives is None else debug_collectives,
        ),
        checkpoint=CheckpointConfig(
            state_dict_type=state_dict_type, async_save=async_save, node_local_storage=node_local_storage
        ),
        activations=ActivationCheckpointConfig(
            policy=activation_checkpointing, offload=activation_checkpointing_offload
        ),
        data_parallel=DataParallelConfig(
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            bucket_cap_mb=bucket_cap_mb,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            torch_kwargs=ddp_kwargs,
        ),
    )


#: the options of :func:`strategy_config` by name (the Trainer strategy passes its own on by these names)
STRATEGY_OPTIONS = tuple(name for name in inspect.signature(strategy_config).parameters if name != "ddp_kwargs")


def new_precision(
    precision: str, config: StrategyConfig, loss_scale: LossScaleConfig | None, cls: type[OffloadPrecision]
) -> OffloadPrecision:
    """A ``cls`` (an :class:`OffloadPrecision`) for ``precision`` with the strategy's offload options."""
    return cls(
        precision,
        offload_optimizer=config.offload.offload_optimizer,
        offload_parameters=config.offload.offload_parameters,
        pin_memory=config.offload.pin_memory,
        loss_scale=loss_scale,
        nvme=config.offload.nvme,
    )


def as_offload_precision(
    plugin: FabricPrecision | None,
    config: StrategyConfig,
    loss_scale: LossScaleConfig | None,
    cls: type[OffloadPrecision] = OffloadPrecision,
) -> OffloadPrecision | None:
    """Lightning and Fabric assign a generic plugin to a strategy chosen by name: keep its precision
    string (and, for an ``OffloadPrecision`` of another class, its own offload options)."""
    if plugin is None or isinstance(plugin, cls):
        return plugin
    if isinstance(plugin, OffloadPrecision):
        scale = plugin.scaler.config if plugin.scaler is not None else loss_scale
        converted = cls(
            plugin.precision,
            offload_optimizer=plugin.offload.offload_optimizer,
            offload_parameters=plugin.offload.offload_parameters,
            pin_memory=plugin.offload.pin_memory,
            loss_scale=scale,
            nvme=plugin.offload.nvme,
            param_dtype="fp32" if plugin.fp32_params else None,
        )
        return converted
    # (A plugin given to the strategy itself reaches here unchanged: Lightning prefers it to the
    # Trainer's precision flag.)
    requested = normalize_precision(getattr(plugin, "precision", "32-true"))
    return new_precision(requested, config, loss_scale, cls)


#: The names both strategy registries (Lightning's ``StrategyRegistry`` and Fabric's ``STRATEGY_REGISTRY``)
#: get when the package is imported: name -> (description, the strategy's keyword arguments).
REGISTERED_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"zero{stage}": (f"lightning_zero ZeRO stage {stage}", {"stage": stage}) for stage in (1, 2, 3)},
    "zero2_offload": (
        "lightning_zero ZeRO stage 2, optimizer offloaded to the CPU",
        {"stage": 2, "offload_optimizer": True},
    ),
    "zero3_offload": (
        "lightning_zero ZeRO stage 3, optimizer and parameters offloaded to the CPU",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
}


def register_names(registry: Any, cls: type) -> None:
    """Register :data:`REGISTERED_NAMES` for ``cls`` in a Lightning or Fabric strategy registry."""
    for name, (description, init_params) in REGISTERED_NAMES.items():
        registry.register(name, cls, description=description, override=True, **init_params)
