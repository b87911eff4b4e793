"""Tensor and pipeline parallelism in the plan: one rank of a D x T x P layout, from the strategy's own
code path (:class:`~lightning_zero.parallel.setup.ParallelSetup`, the tensor-parallel plan, the
pipeline split and its :class:`~lightning_zero.parallel.runner.PipelineRunner`) on meta tensors in a
fake world of every rank.

:func:`plan_model_parallel` runs :func:`~lightning_zero.plan.core.plan` once per differing pipeline
stage, as the first rank of that stage (data- and tensor-parallel rank 0): the layout's groups come
from :func:`~lightning_zero.layout.build_groups` as in a real run, the model is split into the stage
and by the tensor-parallel plan exactly as the strategy splits it (the same broadcasts, the same
tied-weight groups), and the engine is built with the same
:class:`~lightning_zero.zero.ModelParallelContext`. The step is the strategy's: without a pipeline the
forward (the vocabulary-parallel cross entropy when the logits come out of a column-parallel layer,
as the recipes compute it), backward and step; with one, the runner's schedule over the micro-batches
with ZeRO's reductions after every backward, then the step. Every collective is recorded on the group
it runs on: ``data``, ``tensor``, ``pipeline`` (the point-to-point sends and receives, the loss
broadcast, the norm's all-reduce) and ``tied`` (the stages holding a copy of a tied weight).

Stages are compared before planning by their layers (class, parameter names and shapes) and whether
they hold the first or the last virtual stage: among equal stages the first is planned, which under
1F1B keeps the most micro-batches in flight (P - s on stage s), so it is the most loaded of them.

A stage receives what the previous one sends; in one process there is no sender, so the message
shapes (each virtual stage's outputs per micro-batch, and the gradients of those that need one) come
from a forward of the whole model, split by the same tensor-parallel plan, through the pipeline's
layers on meta tensors, before the stage is planned; the receives themselves run through
:mod:`lightning_zero.comm` as in a real run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import comm
from lightning_zero.config import PRECISIONS, OffloadConfig, StrategyConfig, ZeroConfig
from lightning_zero.layout import ParallelLayout
from lightning_zero.parallel.pipeline import plan_stages, resolve_spec
from lightning_zero.parallel.runner import _HEADER, ACTIVATION, Peer, _as_tuple, split_batch
from lightning_zero.parallel.schedules import interleavable, max_in_flight
from lightning_zero.parallel.setup import ParallelSetup
from lightning_zero.parallel.tensor import ColumnParallelLinear, apply_tensor_parallel, check_plan
from lightning_zero.parallel.vocab import vocab_parallel_cross_entropy
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig
from lightning_zero.plan.model import InputSpec, default_inputs, meta_model
from lightning_zero.plan.world import Call, record_collectives

NOT_MODELED = (
    "with a pipeline, the step time charges each action of the schedule its own asynchronous "
    "communication (it does not overlap the next action)",
    "every group (data, tensor, pipeline) runs on the machine's one interconnect",
)

Shapes = dict[tuple[int, int], list[tuple[tuple[int, ...], torch.dtype, bool]]]
"""``(micro-batch, virtual stage)`` -> its outputs: shape, dtype, whether a gradient comes back."""


@dataclass(frozen=True)
class ModelParallelPlan:
    """Where a :class:`~lightning_zero.plan.core.Plan`'s rank sits in a D x T x P layout."""

    data: int
    tensor: int
    pipeline: int
    stage: int
    """The pipeline stage of the planned rank."""
    rank: int
    """The planned global rank: the stage's first (data- and tensor-parallel rank 0)."""
    represents: tuple[int, ...]
    """The stages this plan stands for (equal layers; the first keeps the most in flight)."""
    micro_batches: int
    """Micro-batches the batch is cut into (at most its rows); 1 without a pipeline."""
    chunks: int
    schedule: str
    """The training schedule that ran ("1f1b" or "gpipe"; an interleaved one falls back to "gpipe"
    when the micro-batches do not fill groups of P, as the runner does)."""
    in_flight: int
    """The most micro-batches (per chunk) forwarded and not yet backwarded on this stage."""
    layers: tuple[str, ...]
    """The stage's pipeline layers (qualified names); empty without a pipeline."""
    local_numel: int
    """Parameters this rank holds after the split (each counted once)."""
    group_sizes: dict[str, int]
    """Ranks of each named group this rank belongs to."""
    call_groups: tuple[str, ...]
    """The group of each of the plan's ``step_calls``, in order."""
    stages: tuple[Any, ...] = ()
    """On the returned plan: the plan of every planned stage, this one among them."""


def plan_model_parallel(
    plan_fn: Callable[..., Any],
    model: str,
    world_size: int,
    *,
    tensor: TensorParallelConfig | None,
    pipeline: PipelineConfig | None,
    batch_keys: tuple[str, ...] | None,
    **kwargs: Any,
) -> Any:
    """Plan every differing pipeline stage of ``world_size`` = D x T x P ranks with ``plan_fn``
    (:func:`~lightning_zero.plan.core.plan`, whose other arguments are ``kwargs``); return the plan
    of the most loaded stage (the largest device peak), every planned stage in ``.parallel.stages``."""
    tensor, pipeline = tensor or TensorParallelConfig(), pipeline or PipelineConfig()
    layout = ParallelLayout.for_world(world_size, tensor.size, pipeline.stages)
    # the strategy's own checks across sections (stage 3 with either is refused there)
    StrategyConfig(
        zero=kwargs["zero"] or ZeroConfig(),
        offload=kwargs["offload"] or OffloadConfig(),
        tensor=tensor,
        pipeline=pipeline,
    )
    if batch_keys is not None and pipeline.stages == 1:
        raise ValueError(f"batch_keys={batch_keys} name the inputs of a pipeline's batch; there is no pipeline (P=1).")
    module = meta_model(model, kwargs["model_kwargs"])
    setup = ParallelSetup(tensor=tensor, pipeline=pipeline)
    if tensor.size > 1:  # a missing plan or a pattern that matches nothing: before any work
        check_plan(module, setup.resolve_plan(module), tensor.sequence_parallel)
    specs = kwargs["inputs"]
    if specs is None:
        specs = default_inputs(module, kwargs["micro_batch"], kwargs["seq_len"])
    if batch_keys is not None and len(batch_keys) != len(specs):
        raise ValueError(f"batch_keys={batch_keys} must name each of the {len(specs)} inputs {specs}.")
    kwargs["inputs"] = specs
    stages = _representatives(module, pipeline) if pipeline.stages > 1 else [(0, (0,))]
    shapes: dict[str, Shapes] = {}  # the message shapes, the same for every stage: computed once
    plans = []
    for stage, represents in stages:
        run = StageRun(layout, tensor, pipeline, stage, represents, batch_keys, model, kwargs, shapes)
        plans.append(plan_fn(model, world_size, tensor=tensor, pipeline=pipeline, _stage=run, **kwargs))
    main = max(plans, key=lambda p: p.peak)
    parallel = dataclasses.replace(main.parallel, stages=tuple(plans))
    return dataclasses.replace(main, parallel=parallel, not_modeled=main.not_modeled + NOT_MODELED)


def _layer_signature(layer: nn.Module) -> tuple[Any, ...]:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    return type(layer).__name__, params


def _representatives(module: nn.Module, pipeline: PipelineConfig) -> list[tuple[int, tuple[int, ...]]]:
    """``(stage to plan, stages it stands for)``: stages with equal layers and the same place (first,
    last, between) are planned once, by the first of them."""
    stages, chunks = pipeline.stages, pipeline.chunks
    spec = resolve_spec(module, stages, chunks)
    bounds = plan_stages(module, spec, stages, 0, pipeline.partition, chunks).bounds
    layers = list(spec.layers)
    alike: dict[tuple[Any, ...], list[int]] = {}
    for s in range(stages):
        held = [layer for k in range(s, stages * chunks, stages) for layer in layers[bounds[k] : bounds[k + 1]]]
        key = (tuple(_layer_signature(layer) for layer in held), s == 0, s == stages - 1)
        alike.setdefault(key, []).append(s)
    return sorted((members[0], tuple(members)) for members in alike.values())


class StageRun:
    """The hooks :func:`~lightning_zero.plan.core.plan` calls to plan one rank of one stage."""

    def __init__(
        self,
        layout: ParallelLayout,
        tensor: TensorParallelConfig,
        pipeline: PipelineConfig,
        stage: int,
        represents: tuple[int, ...],
        batch_keys: tuple[str, ...] | None,
        model: str,
        kwargs: dict[str, Any],
        shapes: dict[str, Shapes],
    ) -> None:
        self.layout, self.tensor, self.pipeline = layout, tensor, pipeline
        self.stage, self.represents, self.batch_keys = stage, represents, batch_keys
        self.rank = stage * layout.data * layout.tensor
        self.model, self.model_kwargs, self.shapes = model, kwargs["model_kwargs"], shapes
        self.setup = ParallelSetup(tensor=tensor, pipeline=pipeline)
        self.sizes: dict[str, int] = {}
        self.specs: list[InputSpec] = []
        self.dtype = torch.float32

    def prepare(
        self, module: nn.Module, groups: dict[int, str], setup_calls: list[Call], specs: list[InputSpec], precision: str
    ) -> Any:
        """Make the layout's groups, split ``module`` as the strategy does (recording the setup's
        collectives in ``setup_calls``) and name the groups in ``groups``; the engine's context."""
        self.specs, self.dtype = list(specs), PRECISIONS[precision][0]
        setup = self.setup
        setup.build_groups(self.layout.world_size, "cpu")
        assert setup.groups is not None
        groups.clear()
        named = {"data": setup.groups.dp, "tensor": setup.groups.tp, "pipeline": setup.groups.pp}
        for name, group in named.items():
            groups[id(group)] = name
            self.sizes[name] = comm.world_size(group)
        if setup.pipelined and "shapes" not in self.shapes:
            self.shapes["shapes"] = self._message_shapes()
        start = len(setup_calls)
        with record_collectives(setup_calls, groups):
            setup.apply(module, torch.device("meta"))
        for tied in setup.tied:  # made inside apply(): its broadcast was recorded as "other"
            groups[id(tied.group)] = "tied"
            self.sizes["tied"] = comm.world_size(tied.group)
        setup_calls[start:] = [Call(c.op, "tied", c.nbytes) if c.group == "other" else c for c in setup_calls[start:]]
        return setup.context(setup.dp_group)

    def _batch(self) -> Any:
        tensors = [
            torch.zeros(shape, dtype=self.dtype if dtype.is_floating_point else dtype, device="meta")
            for shape, dtype in self.specs
        ]
        return dict(zip(self.batch_keys, tensors, strict=True)) if self.batch_keys else tuple(tensors)

    def _message_shapes(self) -> Shapes:
        """Every virtual stage's outputs per micro-batch: the whole model, split by the same
        tensor-parallel plan on this rank's group, through the pipeline's layers (not recorded)."""
        assert self.setup.groups is not None
        whole = meta_model(self.model, self.model_kwargs)
        for param in whole.parameters():  # as the engine casts the stage's parameters (not its buffers)
            if param.is_floating_point():
                param.data = param.data.to(self.dtype)
        if self.tensor.size > 1:
            plan = self.setup.resolve_plan(whole)
            apply_tensor_parallel(whole, plan, self.setup.groups.tp, sequence_parallel=self.tensor.sequence_parallel)
        stages, chunks = self.pipeline.stages, self.pipeline.chunks
        spec = resolve_spec(whole, stages, chunks)
        bounds = plan_stages(whole, spec, stages, 0, self.pipeline.partition, chunks).bounds
        micro, _ = split_batch(self._batch(), self.pipeline.num_micro_batches)
        shapes: Shapes = {}
        with torch.enable_grad():
            for i, micro_batch in enumerate(micro):
                out: Any = _as_tuple(spec.inputs(micro_batch), "PipelineSpec.inputs(batch)")
                for k in range(stages * chunks - 1):
                    for layer in spec.layers[bounds[k] : bounds[k + 1]]:
                        out = layer(*(out if isinstance(out, tuple) else (out,)))
                    out = _as_tuple(out, f"the output of virtual stage {k}'s last layer")
                    shapes[(i, k)] = [(tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point()) for t in out]
        return shapes

    def forward(self, module: nn.Module, engine: Any, meter: Any) -> Callable[[list], torch.Tensor | None]:
        """The step's forward: the loss (tensor parallelism alone; core runs backward), or the whole
        pipeline schedule, backwards and reductions included (returns None)."""
        runner = self.setup.runner
        if runner is None:
            return lambda trace: _loss(module, self.specs, self.dtype, self.setup.tp_group)
        planned_recv = _planned_recv(self.shapes["shapes"])

        def run(trace: list) -> None:
            first = [True]
            run_forward, run_backward = runner._run_forward, runner._run_backward

            # each action's events follow its marker: the step time replays the schedule across stages
            def forward(*args: Any) -> Any:
                trace.extend([("phase", "forward"), ("action", "F", args[0], args[1])])
                out = run_forward(*args)
                if first:  # activations: what one micro-batch's forward through one chunk saves
                    meter.stop(module)
                    first.clear()
                return out

            def backward(*args: Any) -> Any:
                trace.extend([("phase", "backward"), ("action", "B", args[0], args[1])])
                return run_backward(*args)

            with (
                mock.patch.object(runner, "_run_forward", forward),
                mock.patch.object(runner, "_run_backward", backward),
                mock.patch.object(Peer, "recv", planned_recv),
            ):
                runner.run(self._batch(), train=True, after_backward=engine.backward_done)
            return None

        return run

    def result(self, module: nn.Module, step_calls: list[Call]) -> ModelParallelPlan:
        """This rank's place in the layout, after the plan's steps."""
        runner, stage_plan = self.setup.runner, self.setup.stage_plan
        schedule = "none"
        micro = 1
        if runner is not None:
            micro = min(self.pipeline.num_micro_batches, self.specs[0][0][0] if self.specs[0][0] else 1)
            schedule = runner.schedule_name
            if self.pipeline.chunks > 1 and not interleavable(self.pipeline.stages, micro):
                schedule = "gpipe"
        return ModelParallelPlan(
            data=self.layout.data,
            tensor=self.layout.tensor,
            pipeline=self.layout.pipeline,
            stage=self.stage,
            rank=self.rank,
            represents=self.represents,
            micro_batches=micro,
            chunks=self.pipeline.chunks,
            schedule=schedule,
            in_flight=max_in_flight(runner.train_actions) if runner is not None else 1,
            layers=tuple(stage_plan.layer_names) if stage_plan is not None else (),
            local_numel=sum(p.numel() for p in {id(p): p for p in module.parameters()}.values()),
            group_sizes=dict(self.sizes),
            call_groups=tuple(c.group for c in step_calls),
        )


def _loss(module: nn.Module, specs: list[InputSpec], dtype: torch.dtype, group: comm.ProcessGroup) -> torch.Tensor:
    """:func:`~lightning_zero.plan.model.loss_fn`'s loss under tensor parallelism: logits that come
    out of a column-parallel layer are sharded over the vocabulary, and their cross entropy is the
    vocabulary-parallel one (its three all-reduces over the tensor-parallel group), as the recipes'."""
    args = [torch.zeros(s, dtype=dtype if d.is_floating_point else d, device="meta") for s, d in specs]
    sharded: set[int] = set()

    def seen(mod: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        sharded.add(output.untyped_storage()._cdata)

    heads = [m for m in module.modules() if isinstance(m, ColumnParallelLinear) and not m.gather_output]
    hooks = [m.register_forward_hook(seen) for m in heads]
    try:
        out = module(*args)
    finally:
        for hook in hooks:
            hook.remove()
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not torch.is_tensor(out):
        raise ValueError(f"{type(module).__name__}'s forward returned {type(out).__name__}; the plan needs a tensor.")
    ids = args[0] if args else None
    if ids is not None and not ids.is_floating_point() and out.dim() == 3 and out.shape[:2] == ids.shape:
        if out.untyped_storage()._cdata in sharded:
            return vocab_parallel_cross_entropy(out.flatten(0, 1), ids.flatten(), group)
        return F.cross_entropy(out.flatten(0, 1).float(), ids.flatten())
    return out.float().mean()


def _planned_recv(shapes: Shapes) -> Callable[..., tuple[list[torch.Tensor], list[bool]]]:
    """:meth:`Peer.recv` with the message's shapes from ``shapes`` instead of its header (a meta
    header holds no values): the header and every tensor are received through :mod:`lightning_zero.comm`."""

    def recv(self: Peer, tag: int, ident: tuple[int, int]) -> tuple[list[torch.Tensor], list[bool]]:
        comm.recv(torch.empty(_HEADER, dtype=torch.int64, device=self.device), self.rank, self.group, tag)
        i, sender = ident
        if tag == ACTIVATION:  # the sender's outputs
            sent = shapes[(i, sender)]
        else:  # the gradients of the outputs the sender received from this virtual stage
            sent = [(shape, dtype, False) for shape, dtype, grad in shapes[(i, sender - 1)] if grad]
        tensors = []
        for shape, dtype, _ in sent:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            comm.recv(tensor, self.rank, self.group, tag)
            tensors.append(tensor)
        return tensors, [grad for _, _, grad in sent]

    return recv


def format_model_parallel(p: Any) -> list[str]:
    """Lines of ``lightning-zero plan`` for a model-parallel plan: the layout and every planned stage."""
    info = p.parallel
    lines = [
        f"layout: {info.data * info.tensor * info.pipeline} ranks = data {info.data} x tensor {info.tensor} x "
        f"pipeline {info.pipeline}; groups of this rank: "
        + ", ".join(f"{name} {size}" for name, size in info.group_sizes.items())
    ]
    if info.pipeline > 1:
        lines.append(
            f"pipeline: {info.micro_batches} micro-batches, schedule {info.schedule}, {info.chunks} chunk(s) per stage; "
            f"the tables above are of stage {info.stage} (rank {info.rank}), the most loaded planned stage"
        )
        lines.append(
            f"  {'stage':>5} {'stands for':16} {'layers':>6} {'parameters':>14} {'in flight':>9} {'peak MiB':>12}"
        )
        for q in info.stages:
            s = q.parallel
            stands = ",".join(str(x) for x in s.represents)
            lines.append(
                f"  {s.stage:5d} {stands[:16]:16} {len(s.layers):6d} {s.local_numel:14,d} {s.in_flight:9d} "
                f"{q.peak / 2**20:12.2f}"
            )
    return lines
