"""Validated configuration objects, one per concern, composed into one :class:`StrategyConfig`.

Every option a user can set lives in a frozen, keyword-only dataclass whose ``__post_init__`` raises
``ValueError`` naming the bad value and the fix, so bad input fails at construction, before any
process group or tensor exists. Checks within one concern live in its section; checks across
sections (offloaded parameters need stage 3, model parallelism needs stage 1 or 2) live in
:class:`StrategyConfig` only. ``ZeroStrategy``'s keyword arguments build it once; the sections are
passed down whole; nothing unpacks them into long argument lists.

The sections live by concern: :mod:`lightning_zero.zero_config` (:class:`ZeroConfig`),
:mod:`lightning_zero.offload_config`, :mod:`lightning_zero.parallel_config`,
:mod:`lightning_zero.precision_config` (the precisions and :class:`LossScaleConfig`),
:mod:`lightning_zero.ddp_args` (torch DDP's arguments); this module holds the checkpoint, failure and
activation-checkpointing sections and :class:`StrategyConfig`, and every section's names are importable from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from lightning_zero.ddp_args import DataParallelConfig

# the offload, precision and ZeRO sections live in their own modules; these names stay importable from here
from lightning_zero.offload_config import AIO_ENGINES as AIO_ENGINES
from lightning_zero.offload_config import OFFLOAD_TIERS as OFFLOAD_TIERS
from lightning_zero.offload_config import NvmeConfig as NvmeConfig
from lightning_zero.offload_config import OffloadConfig
from lightning_zero.offload_config import nvme_config as nvme_config
from lightning_zero.option_fields import OMIT, option
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig
from lightning_zero.precision_config import PRECISIONS as PRECISIONS
from lightning_zero.precision_config import LossScaleConfig as LossScaleConfig
from lightning_zero.precision_config import normalize_precision as normalize_precision
from lightning_zero.zero_config import AUTO_BUCKET_MAX as AUTO_BUCKET_MAX
from lightning_zero.zero_config import AUTO_BUCKET_MIN as AUTO_BUCKET_MIN
from lightning_zero.zero_config import AUTO_SIZED as AUTO_SIZED
from lightning_zero.zero_config import ELEMENT_COUNTS as ELEMENT_COUNTS
from lightning_zero.zero_config import REDUCE_DTYPES as REDUCE_DTYPES
from lightning_zero.zero_config import ZeroConfig
from lightning_zero.zero_config import grad_dtype as grad_dtype


def _default_if_none(value: object) -> object:
    """A keyword whose ``None`` means the field's default (``timeout=None``: 10 minutes)."""
    return OMIT if value is None else value


def _debug_from_env(value: bool | None) -> bool:
    """``debug_collectives=None``: the ``LIGHTNING_ZERO_DEBUG_COLLECTIVES`` environment variable."""
    from lightning_zero import debug  # (debug needs comm, which config does not)

    return debug.debug_from_env() if value is None else value


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How ``trainer.save_checkpoint`` writes (the names of Lightning's ``FSDPStrategy``).

    ``"sharded"`` (default): a directory, every rank writing its own shards in parallel; no rank
    gathers anything, and it loads at any world size and layout. ``"full"``: one ordinary Lightning
    checkpoint file written by rank 0 (the whole model and the optimizer states as torch writes them,
    gathered tensor by tensor from a sharded save), which ``torch.load``, ``load_from_checkpoint``,
    DDP and a single process read; it costs rank 0 host memory for the whole checkpoint.
    """

    state_dict_type: str = option("sharded")
    """"sharded" (a directory of per-rank shards) or "full" (one Lightning checkpoint file from rank 0)."""

    async_save: bool = option(False)
    """Asynchronous save (sharded only): during ``fit`` a save copies this rank's shards into host
    memory and returns; a background thread writes them, and the checkpoint is published (renamed
    into place) at the first step boundary after every rank's writer finished, or at the next save,
    removal or load, or at the end of fit. A failed background write raises on every rank there. Costs
    host memory for one copy of this rank's shards (:mod:`lightning_zero.checkpoint.save`)."""

    node_local_storage: bool = option(False)
    """Node-local checkpoints (DeepSpeed's ``use_node_local_storage``), sharded only, local paths only:
    each node writes its own ranks' files under the checkpoint path *as that node resolves it* (a
    node-local disk such as ``/local_ssd/ck``), with ``lightning.pt``, ``metadata.json`` and the tensors
    ZeRO does not partition written once per node, so each node's directory is enough for its own
    ranks to resume (same world size and layout). ``lightning-zero consolidate`` takes the nodes'
    directories together (:mod:`lightning_zero.checkpoint.io`). Without it every rank writes under rank
    0's directory, which all nodes must see."""

    def __post_init__(self) -> None:
        if not isinstance(self.node_local_storage, bool):
            raise ValueError(f"node_local_storage={self.node_local_storage!r} must be True or False.")
        if self.node_local_storage and self.state_dict_type != "sharded":
            raise ValueError(
                f"node_local_storage=True with state_dict_type={self.state_dict_type!r}: a full checkpoint is one "
                "file that rank 0 assembles from every rank's shards, which it cannot read from other nodes' disks. "
                "Use state_dict_type='sharded' (and `lightning-zero consolidate` over the nodes' directories for one "
                "file), or node_local_storage=False with a shared filesystem."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r}; use 'sharded' (a directory, every rank writes its "
                "shards) or 'full' (one Lightning checkpoint file from rank 0)."
            )
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError(
                f"async_save=True with state_dict_type={self.state_dict_type!r}: only sharded saves are written in "
                "the background (a full checkpoint is assembled on rank 0 from a sharded one). Use "
                "state_dict_type='sharded', or async_save=False."
            )


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How a run notices a lost or stuck rank (see :mod:`lightning_zero.failures`)."""

    timeout: timedelta | int | float = option(
        timedelta(minutes=10),
        accepts="timedelta | float | None",
        given=None,
        note="``None``: 10 minutes.",
        to_field=_default_if_none,
    )
    """Longest wait in one collective before it fails (a ``timedelta``, or seconds). A rank that dies
    closes its connections and gloo fails at once; the timeout bounds the silent cases (a host that
    vanished, a rank stuck in a loop, NCCL). Lightning's default is 30 minutes; raise this if a step,
    a validation loop or a checkpoint save on one rank can keep the others waiting longer."""

    debug_collectives: bool = option(
        False,
        accepts="bool | None",
        given=None,
        note="``None`` reads ``LIGHTNING_ZERO_DEBUG_COLLECTIVES``.",
        to_field=_debug_from_env,
    )
    """Compare every collective across ranks before issuing it (:mod:`lightning_zero.debug`)."""

    @property
    def collective_timeout(self) -> timedelta:
        """``timeout`` as a ``timedelta`` (a number of seconds is converted at construction)."""
        assert isinstance(self.timeout, timedelta)
        return self.timeout

    def __post_init__(self) -> None:
        timeout = self.timeout
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout):
            normalized = timedelta(seconds=timeout)
            object.__setattr__(self, "timeout", normalized)  # frozen: normalize once here
        elif isinstance(timeout, timedelta):
            normalized = timeout
        else:
            raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta or a number of seconds (e.g. 600).")
        if normalized <= timedelta(0):
            raise ValueError(f"timeout={timeout!r} must be positive; the default is 10 minutes (600 s).")
        if not isinstance(self.debug_collectives, bool):
            raise ValueError(f"debug_collectives={self.debug_collectives!r} must be True or False.")


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointConfig:
    """Activation checkpointing (see :mod:`lightning_zero.activations`), named like Lightning's
    ``FSDPStrategy(activation_checkpointing_policy=...)``."""

    policy: Any = option(None, name="activation_checkpointing")
    """Which submodules recompute their forward in backward instead of keeping its activations:
    ``None`` (none), a module class, a set/list/tuple of classes (every instance of them), or a
    callable ``policy(module) -> bool`` asked for every submodule (not the LightningModule itself)."""

    offload: bool = option(False, name="activation_checkpointing_offload")
    """Keep the checkpointed modules' inputs in host memory until backward (accelerators only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.offload, bool):
            raise ValueError(f"activation_checkpointing_offload={self.offload!r} must be True or False.")
        if self.offload and self.policy is None:
            raise ValueError(
                "activation_checkpointing_offload=True keeps the checkpointed activations on the host, but "
                "activation_checkpointing is None: nothing is checkpointed. Give activation_checkpointing too."
            )
        policy = self.policy
        if policy is None or (isinstance(policy, type) and issubclass(policy, torch.nn.Module)):
            return
        if isinstance(policy, (set, frozenset, list, tuple)):
            bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
            if bad or not policy:
                raise ValueError(
                    f"activation_checkpointing={policy!r}: a collection must hold torch.nn.Module subclasses "
                    f"(not {bad!r}), e.g. {{nn.TransformerEncoderLayer}}; use None to turn checkpointing off."
                )
            object.__setattr__(self, "policy", frozenset(policy))  # frozen: normalize once here
            return
        if isinstance(policy, type) or not callable(policy):
            raise ValueError(
                f"activation_checkpointing={policy!r} must be None, an nn.Module subclass, a set of them, or a "
                "callable module -> bool (e.g. lambda m: isinstance(m, Block))."
            )

    def selects(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is checkpointed under this policy."""
        if self.policy is None:
            return False
        if isinstance(self.policy, frozenset):
            return isinstance(module, tuple(self.policy))
        if isinstance(self.policy, type):
            return isinstance(module, self.policy)
        return bool(self.policy(module))


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """Every option of one :class:`~lightning_zero.ZeroStrategy`, by section, with the checks that
    span sections. Built once from the strategy's keyword arguments."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activations: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)

    def __post_init__(self) -> None:
        stage = self.zero.stage
        if self.data_parallel.bucket_cap_mb is not None and self.zero.reduce_bucket_size != "auto":
            raise ValueError(
                f"bucket_cap_mb={self.data_parallel.bucket_cap_mb} and reduce_bucket_size="
                f"{self.zero.reduce_bucket_size!r} both set the gradient bucket size; give one of them "
                "(bucket_cap_mb in MiB as DDP, reduce_bucket_size in elements as DeepSpeed)."
            )
        if self.offload.offload_parameters and stage != 3:
            raise ValueError(
                f"offload_parameters={self.offload.offload_parameters!r} shards parameters into host memory, which "
                f"needs stage=3 (got stage={stage}); "
                "use stage=3, or offload_optimizer=True alone."
            )
        if self.tensor.size > 1 and stage == 3:
            raise ValueError(
                f"tensor_parallel_size={self.tensor.size} with stage=3 is not supported: stage 3 builds models on the "
                "meta device, which cannot be split by a plan before it is materialized; use stage=1 or stage=2"
            )
        if self.pipeline.stages > 1 and stage == 3:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline.stages} with stage=3 is not supported: stage 3 would all-gather "
                "every layer's parameters again for each micro-batch's forward and backward (2m gathers per step), "
                "while the pipeline already divides parameters by the number of stages; use stage=1 (fewest "
                "collectives, as DeepSpeed's pipeline) or stage=2"
            )
