"""DDP's own arguments under ZeRO: each accepted with its ZeRO meaning, or refused with what to use.

A user switching from ``DDPStrategy(find_unused_parameters=True, bucket_cap_mb=50)`` to
``ZeroStrategy`` keeps their arguments: :class:`DataParallelConfig` takes the arguments of Lightning's
``DDPStrategy`` and of ``torch.nn.parallel.DistributedDataParallel`` and says, for each, what it does
here. What ZeRO does anyway (unused parameters, gradients in buckets) is accepted at any value; what
has a ZeRO equivalent is translated (``bucket_cap_mb`` -> ``reduce_bucket_size``); what cannot work
on sharded states (communication hooks, local SGD) is a ``ValueError`` naming the alternative.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.option_fields import option

#: torch DDP's keyword arguments that ZeRO accepts at any value: what it already does, or a DDP
#: optimization whose numbers are the same without it.
ACCEPTED_ANY = {
    "check_reduction": "deprecated in torch and ignored by DDP too",
    "skip_all_reduce_unused_params": "ZeRO reduces the zero gradients of unused parameters: same numbers",
    "batched_grad_copy": "a copy optimization of DDP's reducer; ZeRO copies gradients into its own buckets",
}

#: torch DDP's keyword arguments refused unless left at DDP's default: ``name -> (default, why and what to use)``.
REFUSED: dict[str, tuple[Any, str]] = {
    "device_ids": (
        None,
        "Lightning places each rank on its device; choose devices with Trainer(devices=...) or Fabric(devices=...)",
    ),
    "output_device": (
        None,
        "Lightning places each rank on its device; choose devices with Trainer(devices=...) or Fabric(devices=...)",
    ),
    "dim": (0, "the DataLoader's distributed sampler splits batches across ranks; DDP's dim is for its scatter"),
    "init_sync": (
        True,
        "ZeRO always makes every rank start from rank 0's parameters and buffers (sharded states need one "
        "starting point)",
    ),
    "process_group": (
        None,
        "ZeRO shards over the data-parallel group it builds (see tensor_parallel_size / pipeline_parallel_size)",
    ),
    "delay_all_reduce_named_params": (None, "ZeRO reduces every parameter in its buckets during backward"),
    "param_to_hook_all_reduce": (None, "ZeRO reduces every parameter in its buckets during backward"),
    "mixed_precision": (
        None,
        "use Trainer(precision=...) or Fabric(precision=...), and ZeroStrategy(reduce_dtype=...)",
    ),
    "device_mesh": (
        None,
        "use tensor_parallel_size / pipeline_parallel_size; ZeRO shards over the data-parallel ranks",
    ),
    "bucket_cap_mb_list": (None, "ZeRO buckets have one size: use reduce_bucket_size (elements) or bucket_cap_mb"),
}


def _flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")


@dataclass(frozen=True, kw_only=True)
class DataParallelConfig:
    """The arguments of Lightning's ``DDPStrategy`` and torch's ``DistributedDataParallel`` under ZeRO."""

    broadcast_buffers: bool = option(True)
    """As DDP's default: before the forward of every training step that ends an accumulation window
    (where DDP synchronizes), rank 0's buffers (BatchNorm running statistics, ...) are broadcast to
    every rank, one collective per dtype. ``False``: each rank keeps its own buffers after setup
    (setup always broadcasts them once). torch's ``forward_sync_buffers`` is the same switch."""

    find_unused_parameters: bool = option(False)
    """Accepted at any value: ZeRO handles parameters that get no gradient in a step without it
    (their bucket slots stay zero and are reduced with the rest)."""

    static_graph: bool = option(False)
    """Accepted at any value: a DDP scheduling hint; ZeRO's numbers do not depend on it."""

    gradient_as_bucket_view: bool = option(False)
    """Accepted at any value: DDP's memory saving; ZeRO's gradients always go straight into its
    buckets (``param.grad`` stays ``None``, see ``expose_param_grads``)."""

    bucket_cap_mb: float | None = option(None)
    """DDP's bucket size in MiB: sets ``reduce_bucket_size`` to as many elements of the gradient
    dtype (the compute dtype unless ``reduce_dtype``) as fit in it. Give it or ``reduce_bucket_size``."""

    ddp_comm_state: object | None = option(None)
    """Refused unless ``None``: see ``ddp_comm_hook``."""

    ddp_comm_hook: Any = option(None, accepts="Callable | None")
    """Refused unless ``None``: DDP communication hooks (fp16 compression, PowerSGD) act on DDP's
    ``GradBucket``; ZeRO reduce-scatters its own flat buckets. For compressed gradients use
    ``reduce_dtype="bf16"`` / ``"fp16"``."""

    ddp_comm_wrapper: Any = option(None, accepts="Callable | None")
    """Refused unless ``None``: see ``ddp_comm_hook``."""

    model_averaging_period: int | None = option(None)
    """Refused unless ``None``: post-local SGD averages full replicas every few steps; ZeRO keeps one
    sharded copy of the optimizer states. Use Lightning's ``DDPStrategy`` for local SGD."""

    torch_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """torch ``DistributedDataParallel``'s other keyword arguments (:data:`ACCEPTED_ANY`, :data:`REFUSED`,
    ``forward_sync_buffers``); an unknown name is a ``TypeError``, as DDP's."""

    def __post_init__(self) -> None:
        for name in ("broadcast_buffers", "find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            _flag(name, getattr(self, name))
        cap = self.bucket_cap_mb
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0
        ):
            raise ValueError(f"bucket_cap_mb={cap!r} must be a positive number of MiB (DDP's default is 25).")
        for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: DDP communication hooks act on DDP's GradBucket, while ZeRO "
                    "reduce-scatters its own flat buckets; leave it None. For compressed gradient communication "
                    "use reduce_dtype='bf16' (or 'fp16'), or keep DDPStrategy for other hooks."
                )
        if self.model_averaging_period is not None:
            raise ValueError(
                f"model_averaging_period={self.model_averaging_period!r} (post-local SGD) averages full model "
                "replicas every few steps, but ZeRO keeps one sharded copy of the optimizer states and reduces "
                "gradients every step; leave it None, or use Lightning's DDPStrategy for local SGD."
            )
        self._check_torch_kwargs()

    def _check_torch_kwargs(self) -> None:
        for name, value in self.torch_kwargs.items():
            if name in ACCEPTED_ANY:
                continue
            if name == "forward_sync_buffers":
                if value is not None:
                    _flag(name, value)
                    object.__setattr__(self, "broadcast_buffers", value)  # torch: it wins over broadcast_buffers
                continue
            if name not in REFUSED:
                known = sorted([*ACCEPTED_ANY, *REFUSED, "forward_sync_buffers"])
                raise TypeError(
                    f"ZeroStrategy got an unexpected keyword argument {name!r}; besides its own options it takes "
                    f"DDPStrategy's and DistributedDataParallel's: {known}."
                )
            default, why = REFUSED[name]
            if value != default:
                raise ValueError(
                    f"{name}={value!r} is DistributedDataParallel's; under ZeRO {why}. Leave it {default!r}."
                )

    def reduce_bucket_numel(self, itemsize: int) -> int | None:
        """``bucket_cap_mb`` in elements of ``itemsize`` bytes (``None`` when not given)."""
        if self.bucket_cap_mb is None:
            return None
        return max(1, int(self.bucket_cap_mb * (1 << 20)) // itemsize)


class BufferSync:
    """``broadcast_buffers`` for both strategies, with DDP's rule: a forward that DDP runs (the step
    methods during ``fit``; Fabric: the model's forward) starts with a broadcast of rank 0's buffers
    when the previous one synchronized gradients (grad enabled, outside ``no_sync``: Lightning's
    ``block_backward_sync``, Fabric's ``no_backward_sync``), or is the first; in manual optimization
    when a ``manual_backward`` came since (DDP's ``require_forward_param_sync``). With accumulation
    that is the first micro-batch of each window; after a validation run, not the first training forward."""

    def __init__(self) -> None:
        self.blocked = False
        self.due = True  # a freshly wrapped DDP model broadcasts before its first forward

    @contextmanager
    def blocking(self) -> Generator[None, None, None]:
        """Inside: forwards do not make the next one broadcast (DDP's ``no_sync``)."""
        self.blocked = True
        try:
            yield
        finally:
            self.blocked = False

    @contextmanager
    def forward(
        self, config: DataParallelConfig, module: nn.Module | None, group: comm.ProcessGroup, manual: bool = False
    ) -> Generator[None, None, None]:
        """Around one forward that DDP runs (``manual``: under manual optimization). Call on all ranks."""
        self.before(config, module, group)
        try:
            yield
        finally:
            self.after(manual)

    def before(self, config: DataParallelConfig, module: nn.Module | None, group: comm.ProcessGroup) -> None:
        """At the start of a forward DDP runs: the broadcast, when due. Call on all ranks."""
        if config.broadcast_buffers and self.due and module is not None:
            comm.broadcast_buffers(list(module.buffers()), group)

    def after(self, manual: bool = False) -> None:
        """At its end: whether the next forward broadcasts (this one synchronizes gradients)."""
        self.due = torch.is_grad_enabled() and not self.blocked and not manual

    def manual_backward(self) -> None:
        """Manual optimization: a backward outside ``no_sync`` makes the next forward broadcast."""
        self.due = torch.is_grad_enabled() and not self.blocked
