"""What :class:`~lightning_zero.ZeroStrategy` does for tensor and pipeline parallelism, kept out of the strategy.

Order inside the strategy: the arguments are validated at construction; ``setup_distributed``
builds the layout's process groups once (the world size is known there); ``setup`` keeps this
rank's pipeline stage while the model is still on the host (the other stages' layers become
placeholders, so they never reach the device), moves it to the device, makes replicas equal
(broadcasts over the data- and tensor-parallel groups and between the stages sharing a tied
weight), splits the layers by the tensor-parallel plan (before ``configure_optimizers`` sees the
parameters), and gives the ZeRO engine, at its construction, a
:class:`~lightning_zero.zero.surface.ModelParallelContext`: the tensor- and pipeline-parallel
groups (global gradient norm) and the parameters tied across stages.
ZeRO itself shards over the data-parallel group only, and the sampler shards data over it too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import PipelineConfig, TensorParallelConfig
from lightning_zero.layout import ParallelLayout, ProcessGroups, build_groups
from lightning_zero.parallel.pipeline import (
    PipelineSpec,
    RemoteLayer,
    StagePlan,
    TiedParameter,
    plan_stages,
    resolve_spec,
    split_stages,
)
from lightning_zero.parallel.runner import PipelineRunner
from lightning_zero.parallel.tensor import apply_tensor_parallel, check_plan
from lightning_zero.zero import ModelParallelContext, TiedAcrossStages

_APPLIED = "_lightning_zero_model_parallel"  # marks a LightningModule already converted


class ParallelSetup:
    """Tensor- and pipeline-parallel state of one strategy.

    Args:
        tensor: the tensor-parallel options (``tensor.size`` is T; 1: no split).
        pipeline: the pipeline options; ``pipeline.stages`` is P (1: no pipeline).

    Both come from one validated :class:`~lightning_zero.config.StrategyConfig`, which also checked
    them against the ZeRO stage (model parallelism composes with stages 1 and 2).
    """

    def __init__(self, *, tensor: TensorParallelConfig, pipeline: PipelineConfig) -> None:
        self.tensor_config, self.pipeline = tensor, pipeline
        self.tensor, self.plan, self.sequence_parallel = tensor.size, tensor.plan, tensor.sequence_parallel
        self.groups: ProcessGroups | None = None
        self.layout: ParallelLayout | None = None
        self.spec: PipelineSpec | None = None
        self.stage_plan: StagePlan | None = None
        self.runner: PipelineRunner | None = None
        self.tied: list[TiedAcrossStages] = []

    @property
    def pipelined(self) -> bool:
        return self.pipeline.stages > 1

    @property
    def dp_group(self) -> comm.ProcessGroup:
        """The data-parallel group (``None``, the default group, without model parallelism)."""
        return None if self.groups is None else self.groups.dp

    @property
    def tp_group(self) -> comm.ProcessGroup:
        """The tensor-parallel group (``None`` without tensor parallelism)."""
        return None if self.groups is None or self.tensor == 1 else self.groups.tp

    @property
    def pp_group(self) -> comm.ProcessGroup:
        """The pipeline-parallel group (``None`` without pipeline parallelism)."""
        return None if self.groups is None or not self.pipelined else self.groups.pp

    def build_groups(self, world_size: int, device_type: str) -> None:
        """Validate the layout against ``world_size`` and make the groups. Call on all ranks."""
        self.layout = ParallelLayout.for_world(world_size, self.tensor, self.pipeline.stages)
        if (self.tensor > 1 or self.pipelined) and self.groups is None:
            self.groups = build_groups(self.layout, device_type)

    def sampler_kwargs(self, world_size: int, global_rank: int) -> dict[str, Any]:
        """``DistributedSampler`` arguments: one data shard per data-parallel rank."""
        layout = self.layout or ParallelLayout.for_world(world_size, self.tensor, self.pipeline.stages)
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

    def split(self, module: nn.Module) -> None:
        """Pipeline: keep this rank's stage of ``module`` (the others' layers become placeholders).
        Pure, no communication: call before the model moves to the device, so that only the stage's
        own layers ever reach it."""
        if not self.pipelined or self.groups is None or self.stage_plan is not None:
            return
        spec = resolve_spec(module, self.pipeline.stages, self.pipeline.chunks)
        stage_plan = plan_stages(
            module, spec, self.pipeline.stages, self.groups.coords.pp, self.pipeline.partition, self.pipeline.chunks
        )
        if self.tensor > 1:  # against the whole model, the same on every rank
            check_plan(module, self.resolve_plan(module), self.sequence_parallel)
        split_stages(module, spec, stage_plan)
        self.spec, self.stage_plan = spec, stage_plan

    def apply(self, module: nn.Module, device: torch.device) -> None:
        """After :meth:`split` and the move to the device: make replicas equal, split the layers by
        the tensor-parallel plan, tie the copies shared across stages (once). Call on all ranks."""
        if self.groups is None or getattr(module, _APPLIED, False):
            return
        self.split(module)
        tied_groups = self._tied_groups() if self.pipelined else []
        # The splits must come from one whole layer, replicas must be equal: every rank of a stage
        # takes the weights of its first data- and tensor-parallel rank (global rank 0's without a
        # pipeline), and the copies of a tied weight those of the first stage holding it.
        tensors = [p.data for p in module.parameters()] + list(module.buffers())
        comm.broadcast_tensors(tensors, self.groups.dp)
        comm.broadcast_tensors(tensors, self.groups.tp)
        for tied, group in tied_groups:
            if self.groups.coords.pp in tied.names:
                comm.broadcast_tensors([module.get_parameter(tied.names[self.groups.coords.pp]).data], group)
        if self.tensor > 1:
            plan = self.resolve_plan(module)
            apply_tensor_parallel(
                module,
                _local_plan(module, plan) if self.pipelined else plan,
                self.groups.tp,
                sequence_parallel=self.sequence_parallel,
                check=not self.pipelined,  # a stage's modules: split() checked the whole plan
            )
        if self.pipelined:
            assert self.spec is not None and self.stage_plan is not None
            self._tie(module, tied_groups)
            self.runner = PipelineRunner(
                self.stage_plan.chunks,
                self.spec,
                stage=self.stage_plan.stage,
                config=self.pipeline,
                group=self.groups.pp,
                device=device,
            )
        setattr(module, _APPLIED, True)

    def _tied_groups(self) -> list[tuple[TiedParameter, comm.ProcessGroup]]:
        """For every tied parameter, this rank's group over the stages holding it (the same data- and
        tensor-parallel coordinates). Every rank makes every group, in the same order."""
        assert self.stage_plan is not None and self.layout is not None and self.groups is not None
        layout, here = self.layout, self.groups.coords
        out: list[tuple[TiedParameter, comm.ProcessGroup]] = []
        for tied in self.stage_plan.tied:
            mine = None
            for d in range(layout.data):
                for t in range(layout.tensor):
                    ranks = [s * layout.data * layout.tensor + d * layout.tensor + t for s in tied.stages]
                    group = comm.new_group(ranks)
                    if d == here.dp and t == here.tp:
                        mine = group
            out.append((tied, mine))
        return out

    def _tie(self, module: nn.Module, tied_groups: list[tuple[TiedParameter, comm.ProcessGroup]]) -> None:
        """Record this stage's copies of tied parameters (after the tensor-parallel split) for the reducer."""
        assert self.groups is not None
        here = self.groups.coords.pp
        for tied, group in tied_groups:
            if here not in tied.names:
                continue
            param = module.get_parameter(tied.names[here])
            shapes = comm.all_gather_object(tuple(param.shape), group)
            if len(set(shapes)) != 1:
                raise ValueError(
                    f"parameter {tied.names} is tied across pipeline stages {tied.stages} but has shapes {shapes} "
                    "there (a tensor-parallel plan splits one side only); split both tied modules alike or neither"
                )
            # Its names on the other stages: a checkpoint stores the weight once, under every name.
            param.tied_names = tuple(tied.names[s] for s in tied.stages if s != here)  # type: ignore[attr-defined]  # a tag on the Parameter
            self.tied.append(TiedAcrossStages(param, group, counted_here=here == tied.stages[0]))

    def context(self, data: comm.ProcessGroup) -> ModelParallelContext:
        """The groups and tied parameters the ZeRO engine is built with (``data``: the group it
        shards over, possibly wrapped by the collective checker)."""
        return ModelParallelContext(data=data, tensor=self.tp_group, pipeline=self.pp_group, tied=tuple(self.tied))


def _local_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """The patterns of ``plan`` that match a module this stage kept."""
    names = [n for n, m in module.named_modules() if n and not isinstance(m, RemoteLayer)]
    return {p: s for p, s in plan.items() if any(fnmatch.fnmatchcase(n, p) for n in names)}
