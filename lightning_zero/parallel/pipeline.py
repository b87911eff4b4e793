"""Pipeline parallelism: a model given as a sequence of layers, split into balanced stages.

The LightningModule stays a normal LightningModule and adds one hook, ``configure_pipeline()``,
returning a :class:`PipelineSpec`: its layers in order (``layers[i+1]`` takes what ``layers[i]``
returns), the loss applied to the last layer's output, and what the first layer gets from a batch::

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(
            layers=self.model.to_layers(),
            loss=lambda logits, batch: F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()),
            inputs=lambda batch: batch["input_ids"],
        )

With ``ZeroStrategy(pipeline_parallel_size=P)`` the strategy then, at setup:

1. **balances** the layers over P stages (:func:`balance`): contiguous runs whose largest weight
   (parameter count, layer count, or the count of layers of a type) is as small as possible;
2. **splits** the module (:func:`split_stages`): on stage s, every layer of another stage is replaced
   in its parent by a parameter-less :class:`RemoteLayer`, so ``configure_optimizers``, ZeRO and
   checkpoints see only this stage's parameters, under their usual names;
3. **ties** parameters that layers of several stages share (GPT-2's token embedding and LM head):
   each of those stages keeps its copy, their gradients are summed over the stages that hold them
   (:class:`TiedParameter`) before the data-parallel reduction, so the copies stay equal;

and in ``training_step`` runs the schedule of :mod:`.schedules` with :mod:`.runner`.

Why not ``torch.distributed.pipelining``: its schedules run every micro-batch's backward inside one
``step()`` call, without a hook between them, but ZeRO stage 2 must complete a bucket reduction
after each backward (:meth:`~lightning_zero.zero.engine.ZeroEngine.backward_done`); its loss
function takes ``(output, target)`` tensors where a Lightning batch is any structure; and it has no
notion of parameters tied across stages. The schedules are small (:mod:`.schedules`); owning them
keeps ZeRO's reduction, loss scaling and Lightning's gradient accumulation in one place.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def default_inputs(batch: Any) -> Any:
    """``batch["input_ids"]`` of a dict batch, the first element of a tuple/list, else the batch."""
    if isinstance(batch, dict):
        if "input_ids" not in batch:
            raise ValueError(
                f"PipelineSpec.inputs is not given and the batch has no 'input_ids' (keys {sorted(batch)}); "
                "pass inputs=lambda batch: ... returning what the first layer takes"
            )
        return batch["input_ids"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


@dataclass(frozen=True)
class PipelineSpec:
    """What ``LightningModule.configure_pipeline()`` returns.

    Args:
        layers: submodules of the LightningModule in execution order; chaining them is the model.
            A layer may return a tensor or a tuple of tensors (passed on as positional arguments).
        loss: ``loss(last_layer_output, micro_batch) -> scalar`` mean loss of one micro-batch.
        inputs: ``inputs(micro_batch)`` -> the first layer's input (a tensor or a tuple of them).
        name: logged as ``train_<name>``, ``val_<name>`` and ``test_<name>`` (the true loss, from the
            last stage, on every rank).
        on_eval: optional ``on_eval(loss, batch)``, called on every rank after each validation or
            test batch with that batch's true loss, e.g. to update a metric derived from it (the
            LightningModule's own ``validation_step`` does not run under pipeline parallelism).
    """

    layers: Sequence[nn.Module]
    loss: Callable[[Any, Any], torch.Tensor]
    inputs: Callable[[Any], Any] = default_inputs
    name: str = "loss"
    on_eval: Callable[[torch.Tensor, Any], None] | None = None

    def __post_init__(self) -> None:
        if not self.layers or not all(isinstance(layer, nn.Module) for layer in self.layers):
            raise ValueError(f"PipelineSpec.layers must be a non-empty sequence of nn.Module, got {self.layers!r}")
        if len({id(layer) for layer in self.layers}) != len(self.layers):
            raise ValueError("PipelineSpec.layers lists the same module twice; each layer runs on one stage")
        if not callable(self.loss) or not callable(self.inputs):
            raise ValueError("PipelineSpec.loss and PipelineSpec.inputs must be callables")


def resolve_spec(module: nn.Module, stages: int, chunks: int = 1) -> PipelineSpec:
    """``module.configure_pipeline()``, checked against ``stages`` x ``chunks`` virtual stages."""
    hook = getattr(module, "configure_pipeline", None)
    if not callable(hook):
        raise ValueError(
            f"pipeline_parallel_size={stages} needs {type(module).__name__}.configure_pipeline() returning "
            "lightning_zero.PipelineSpec(layers=[...], loss=...); see lightning_zero.parallel.pipeline"
        )
    spec = hook()
    if not isinstance(spec, PipelineSpec):
        raise ValueError(f"configure_pipeline() returned {type(spec).__name__}; it must return a PipelineSpec")
    if stages * chunks > len(spec.layers):
        raise ValueError(
            f"pipeline_parallel_size={stages} x pipeline_chunks={chunks} = {stages * chunks} virtual stages exceed "
            f"the model's {len(spec.layers)} pipeline layers; every virtual stage needs at least one layer"
        )
    return spec


# -- 1. balance ------------------------------------------------------------------------------------


def layer_weights(layers: Sequence[nn.Module], method: str) -> list[tuple[int, ...]]:
    """The weight of each layer that :func:`balance` evenly spreads (compared as tuples, first
    element first): ``"parameters"``: (numel,), ``"uniform"``: (1, numel), ``"type:<regex>"``:
    (1 if the class name matches, numel)."""
    numels = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    if method == "parameters":
        return [(n,) for n in numels]
    if method == "uniform":
        return [(1, n) for n in numels]
    if method.startswith("type:"):
        pattern = re.compile(method[len("type:") :])
        weights: list[tuple[int, ...]] = [
            (1 if pattern.search(type(layer).__name__) else 0, n) for layer, n in zip(layers, numels, strict=True)
        ]
        if not any(w[0] for w in weights):
            names = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(f"pipeline_partition={method!r} matches none of the layer classes {names}")
        return weights
    raise ValueError(f"unknown pipeline partition {method!r}")


def balance(weights: Sequence[tuple[int, ...]], stages: int) -> list[int]:
    """Stage boundaries ``[0, b1, ..., len(weights)]`` of contiguous, non-empty stages whose largest
    total weight is the smallest possible (tuples compare lexicographically) and, among those, whose
    totals are the most even (smallest sum of squares): the largest stage (say, the embedding)
    often fixes the maximum alone, and the others should still split evenly. Two dynamic programs
    over (stages, prefix): O(stages * n^2) for n layers."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    width = len(weights[0]) if weights else 1
    prefix = [(0,) * width]
    for w in weights:
        prefix.append(tuple(a + b for a, b in zip(prefix[-1], w, strict=True)))

    def cost(i: int, j: int) -> tuple[int, ...]:  # total weight of layers [i, j)
        return tuple(b - a for a, b in zip(prefix[i], prefix[j], strict=True))

    def solve(combine, start, limit=None) -> tuple[list[list], list[list[int]]]:
        # best[k][j]: the best value for the first j layers in k stages; cut[k][j] its last start
        best: list[list] = [[None] * (n + 1) for _ in range(stages + 1)]
        cut = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = start
        for k in range(1, stages + 1):
            for j in range(k, n - (stages - k) + 1):
                for i in range(k - 1, j):
                    c = cost(i, j)
                    if best[k - 1][i] is None or (limit is not None and c > limit):
                        continue
                    candidate = combine(best[k - 1][i], c)
                    if best[k][j] is None or candidate < best[k][j]:
                        best[k][j], cut[k][j] = candidate, i
        return best, cut

    best, _ = solve(max, (0,) * width)
    largest = best[stages][n]
    _, cut = solve(lambda acc, c: tuple(a + b * b for a, b in zip(acc, c, strict=True)), (0,) * width, limit=largest)
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


# -- 2. split ----------------------------------------------------------------------------------


class RemoteLayer(nn.Module):
    """Stands in for a layer that runs on another pipeline stage; calling it is an error."""

    def __init__(self, name: str, stage: int, here: int) -> None:
        super().__init__()
        self.layer_name, self.stage, self.here = name, stage, here

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.layer_name} runs on pipeline stage {self.stage}, not on this rank (stage {self.here}). Under "
            "pipeline parallelism ZeroStrategy runs the layers of configure_pipeline() itself; training_step, "
            "validation_step and forward of the whole model are not called."
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name} on stage {self.stage}"


@dataclass(frozen=True)
class TiedParameter:
    """A parameter used by layers of several stages: ``names[s]`` is its name on stage ``s``."""

    names: dict[int, str] = field(hash=False)

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted(self.names))


@dataclass
class StagePlan:
    """What :func:`plan_stages` decided: the boundaries of the ``stages * chunks`` virtual stages
    (virtual stage ``k`` runs on stage ``k % stages``), this stage's chunks of layers, the tied
    parameters."""

    bounds: list[int]
    stage: int
    stages: int
    chunks: list[list[nn.Module]]
    layer_names: list[str]
    tied: list[TiedParameter]

    def stage_of(self, virtual: int) -> int:
        return virtual % self.stages


def _qualified_names(root: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    where = {id(m): name for name, m in root.named_modules(remove_duplicate=False) if name}
    missing = [i for i, layer in enumerate(layers) if id(layer) not in where]
    if missing:
        raise ValueError(
            f"pipeline layers {missing} are not submodules of {type(root).__name__}; register every layer in the "
            "LightningModule (e.g. self.model = ...) so that its parameters are trained and checkpointed"
        )
    return [where[id(layer)] for layer in layers]


def plan_stages(
    root: nn.Module, spec: PipelineSpec, stages: int, stage: int, partition: str, chunks: int = 1
) -> StagePlan:
    """Decide the split without changing ``root`` (pure; every rank computes the same plan). With
    ``chunks > 1`` the layers form ``stages * chunks`` balanced virtual stages, dealt round-robin."""
    layers = list(spec.layers)
    names = _qualified_names(root, layers)
    virtual = stages * chunks
    bounds = balance(layer_weights(layers, partition), virtual)
    stage_of = [k % stages for k in range(virtual) for _ in range(bounds[k], bounds[k + 1])]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    outside = [n for n, p in root.named_parameters() if p.requires_grad and id(p) not in in_layers]
    if outside:
        raise ValueError(
            f"trainable parameters {outside[:4]} belong to no pipeline layer; add their modules to "
            "configure_pipeline().layers or freeze them (requires_grad=False)"
        )
    seen: dict[int, dict[int, str]] = {}
    for index, (layer, name) in enumerate(zip(layers, names, strict=True)):
        for pname, param in layer.named_parameters(remove_duplicate=False):
            seen.setdefault(id(param), {}).setdefault(stage_of[index], f"{name}.{pname}")
    tied = [TiedParameter(names=by_stage) for by_stage in seen.values() if len(by_stage) > 1]
    mine = range(stage, virtual, stages)
    local_chunks = [layers[bounds[k] : bounds[k + 1]] for k in mine]
    local_names = [names[i] for k in mine for i in range(bounds[k], bounds[k + 1])]
    return StagePlan(bounds, stage, stages, local_chunks, local_names, tied)


def split_stages(root: nn.Module, spec: PipelineSpec, plan: StagePlan) -> None:
    """Replace every layer of another stage by a :class:`RemoteLayer` in ``root`` (in place)."""
    layers = list(spec.layers)
    names = _qualified_names(root, layers)
    for k in range(len(plan.bounds) - 1):
        if plan.stage_of(k) == plan.stage:
            continue
        for i in range(plan.bounds[k], plan.bounds[k + 1]):
            parent_name, _, child = names[i].rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            setattr(parent, child, RemoteLayer(names[i], plan.stage_of(k), plan.stage))
