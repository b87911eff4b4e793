"""What :class:`~lightning_zero.ZeroStrategy` does for tensor parallelism, kept out of the strategy.

Order inside the strategy: the arguments are validated at construction; ``setup_distributed``
builds the layout's process groups once (the world size is known there); ``setup`` makes the model
equal on every rank, applies the plan (before ``configure_optimizers`` sees the parameters) and
hands the tensor-parallel group to the ZeRO optimizers' global gradient norm. ZeRO itself shards
over the data-parallel group only, and the sampler shards data over it too.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from lightning_zero import comm
from lightning_zero.layout import ParallelLayout, ProcessGroups, build_groups
from lightning_zero.parallel.tensor import apply_tensor_parallel

_APPLIED = "_lightning_zero_tensor_parallel"  # marks a LightningModule already converted


class TensorParallelSetup:
    """Tensor-parallel state of one strategy.

    Args:
        tensor: T, the tensor-parallel size (1: nothing happens, no groups are made).
        pipeline: P; only 1 is available now.
        plan: module-name pattern -> style, or ``None`` for the LightningModule's own plan.
        stage: the ZeRO stage (tensor parallelism composes with stages 1 and 2).
    """

    def __init__(self, tensor: int, pipeline: int, plan: Optional[Mapping[str, str]], stage: int) -> None:
        for name, value in (("tensor_parallel_size", tensor), ("pipeline_parallel_size", pipeline)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} is {value!r}; it must be an integer of at least 1")
        if pipeline > 1:
            raise ValueError(
                f"pipeline_parallel_size={pipeline}: pipeline parallelism is not available yet; use "
                "pipeline_parallel_size=1 (tensor_parallel_size and ZeRO data parallelism work)"
            )
        if tensor > 1 and stage == 3:
            raise ValueError(
                f"tensor_parallel_size={tensor} with stage=3 is not supported: stage 3 builds models on the meta "
                "device, which cannot be split by a plan before it is materialized; use stage=1 or stage=2"
            )
        self.tensor, self.pipeline, self.plan = tensor, pipeline, plan
        self.groups: Optional[ProcessGroups] = None
        self.layout: Optional[ParallelLayout] = None

    @property
    def dp_group(self) -> comm.ProcessGroup:
        """The data-parallel group (``None``, the default group, without tensor parallelism)."""
        return None if self.groups is None else self.groups.dp

    @property
    def tp_group(self) -> comm.ProcessGroup:
        """The tensor-parallel group (``None`` without tensor parallelism)."""
        return None if self.groups is None else self.groups.tp

    def build_groups(self, world_size: int, device_type: str) -> None:
        """Validate the layout against ``world_size`` and make the groups. Call on all ranks."""
        self.layout = ParallelLayout.for_world(world_size, self.tensor, self.pipeline)
        if self.tensor > 1 and self.groups is None:
            self.groups = build_groups(self.layout, device_type)

    def sampler_kwargs(self, world_size: int, global_rank: int) -> dict[str, Any]:
        """``DistributedSampler`` arguments: one data shard per data-parallel rank."""
        layout = self.layout or ParallelLayout.for_world(world_size, self.tensor, self.pipeline)
        return {"num_replicas": layout.data, "rank": layout.coordinates(global_rank).dp}

    def resolve_plan(self, module: nn.Module) -> Mapping[str, str]:
        """The plan given to the strategy, else the module's ``tensor_parallel_plan`` (method or attribute)."""
        if self.plan is not None:
            return self.plan
        plan = getattr(module, "tensor_parallel_plan", None)
        plan = plan() if callable(plan) else plan
        if plan is None:
            raise ValueError(
                f"tensor_parallel_size={self.tensor} needs a plan: pass ZeroStrategy(tensor_parallel_plan={{pattern: "
                f"style}}) or give {type(module).__name__} a tensor_parallel_plan() method returning one"
            )
        return plan

    def apply(self, module: nn.Module) -> None:
        """Make ``module`` equal on every rank, then split it by the plan (once). Call on all ranks."""
        if self.groups is None or getattr(module, _APPLIED, False):
            return
        plan = self.resolve_plan(module)
        # Replicated parameters must be equal on the ranks of a tensor-parallel group, and the
        # splits must come from one whole model: start every rank from global rank 0's weights.
        comm.broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), None)
        apply_tensor_parallel(module, plan, self.groups.tp)
        setattr(module, _APPLIED, True)

    def attach(self, engine: Any) -> None:
        """Give every ZeRO optimizer the tensor-parallel group, for its global gradient norm."""
        if self.groups is None:
            return
        for sharded in engine.sharded.values():
            sharded.tensor_parallel_group = self.groups.tp
