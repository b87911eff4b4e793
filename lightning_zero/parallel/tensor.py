"""Megatron-style tensor parallelism over plain tensors, applied to an existing model by a plan.

A column-parallel Linear keeps rows ``[r*out/T, (r+1)*out/T)`` of the weight (output features) and
yields a sharded activation; the row-parallel Linear that follows keeps the matching columns (input
features) and sums its partial products with one all-reduce. Forward costs one all-reduce per
column/row pair and backward one (the :mod:`~lightning_zero.parallel.mappings` pairs). The
vocabulary-parallel embedding keeps a contiguous range of rows and all-reduces the looked-up vectors.

Tied weights: a token embedding tied to the LM head (GPT-2, BERT's MLM decoder) is split as Megatron
splits it, the Embedding ``"vocab"`` and the head Linear ``"column"``; both keep the same vocabulary
rows, so :func:`apply_tensor_parallel` gives them one new shard Parameter (the tie survives, its
gradient sums both uses). The head's output is then logits sharded over the vocabulary, (..., V/T),
for :mod:`~lightning_zero.parallel.vocab` (cross entropy, argmax) without ever gathering (..., V).

Why not ``torch.distributed.tensor.parallel.parallelize_module``: it runs on CPU/gloo in torch 2.13
(checked: ``ColwiseParallel``/``RowwiseParallel`` forward and backward on 2 gloo ranks), but it
turns parameters into ``DTensor``s, and our ZeRO engine flattens plain parameters into flat buffers
whose slices become ``param.data``, reduce-scatters ``.grad`` tensors and steps fp32 slices. A DTensor
parameter defeats each of those steps: ``torch.cat`` of DTensors redistributes them,
assigning a plain tensor to a DTensor's ``.data`` keeps the DTensor wrapper with its global shape,
and its gradients are DTensors again. Here parameters stay plain tensors holding their local shard,
so the engine flattens and shards them over the data-parallel group unchanged.

Sharded parameters carry ``param.tensor_parallel = True`` and ``param.partition_dim`` (see
:func:`is_tensor_parallel`): global gradient norms count them on every tensor-parallel rank and
replicated parameters on tensor-parallel rank 0 only, as Megatron does.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import comm
from lightning_zero.parallel import sequence
from lightning_zero.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_last_dim,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)
from lightning_zero.parallel.vocab import vocab_parallel_cross_entropy  # noqa: F401 (its former home)

STYLES = ("column", "row", "vocab", "replicate", "sequence", "sequence_scatter")
"""What a plan may ask of a module: split a Linear by output or input features, split an Embedding
by rows (vocabulary), or keep it whole on every tensor-parallel rank. The last two keep it whole too
and matter under sequence parallelism only (:mod:`~lightning_zero.parallel.sequence`): ``"sequence"``
runs on this rank's sequence chunk (LayerNorm), ``"sequence_scatter"`` splits its output along the
sequence (the embedding, where the region starts); without it both mean ``"replicate"``."""
_SEQUENCE_STYLES = ("sequence", "sequence_scatter")


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> nn.Parameter:
    """Mark ``param`` as this rank's shard along ``partition_dim`` of a tensor-parallel parameter."""
    param.tensor_parallel = True  # type: ignore[attr-defined]  # a tag on the Parameter, read by checkpoints
    param.partition_dim = partition_dim  # type: ignore[attr-defined]  # a tag on the Parameter
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a parameter split over the tensor-parallel group (each rank holds a different shard)."""
    return bool(getattr(param, "tensor_parallel", False))


def _split(size: int, group: comm.ProcessGroup, what: str) -> tuple[int, int]:
    """(start, length) of this rank's contiguous share of ``size``."""
    world = comm.world_size(group)
    if size % world:
        raise ValueError(f"{what} is {size}, not divisible by the tensor-parallel size {world}")
    length = size // world
    return comm.rank(group) * length, length


def _shard(full: torch.Tensor, dim: int, start: int, length: int) -> nn.Parameter:
    return mark_tensor_parallel(nn.Parameter(full.detach().narrow(dim, start, length).clone(), full.requires_grad), dim)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` (out, in) split by rows: weight (out/T, in), bias (out/T).

    Input (..., in) replicated; output (..., out/T) sharded, or (..., out) with ``gather_output``.
    With ``sequence_parallel`` the input is this rank's sequence chunk (batch, seq/T, in), all-gathered
    to (batch, seq, in) first.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: comm.ProcessGroup,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.group, self.gather_output = weight, bias, group, gather_output
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: comm.ProcessGroup, gather_output: bool = False, sequence_parallel: bool = False
    ) -> ColumnParallelLinear:
        """This rank's rows of ``linear`` (whose weights must be equal on every rank of ``group``)."""
        start, length = _split(linear.out_features, group, f"out_features of {linear}")
        bias = None if linear.bias is None else _shard(linear.bias, 0, start, length)
        return cls(_shard(linear.weight, 0, start, length), bias, group, gather_output, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out/T), or (..., out) when gathering."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, self.group, sequence.SEQUENCE_DIM)
        else:
            x = copy_to_tensor_parallel(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` (out, in) split by columns: weight (out, in/T); bias (out) whole.

    Input (..., in/T) sharded (the output of a :class:`ColumnParallelLinear`); output (..., out)
    replicated after one all-reduce; the bias is added after it, once. With ``sequence_parallel`` a
    reduce-scatter along the sequence replaces the all-reduce: output (batch, seq/T, out), and the
    bias, added to one chunk per rank, has its gradient summed over the group.
    """

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, group: comm.ProcessGroup, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.group, self.sequence_parallel = weight, bias, group, sequence_parallel
        if sequence_parallel and bias is not None:
            sequence.mark_sequence_parallel(bias, group)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: comm.ProcessGroup, sequence_parallel: bool = False
    ) -> RowParallelLinear:
        """This rank's columns of ``linear``; the bias Parameter is kept (replicated)."""
        start, length = _split(linear.in_features, group, f"in_features of {linear}")
        return cls(_shard(linear.weight, 1, start, length), linear.bias, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in/T) -> (..., out), or (batch, seq/T, out) under sequence parallelism."""
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(y, self.group, sequence.SEQUENCE_DIM)
        else:
            y = reduce_from_tensor_parallel(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (vocabulary) are split: weight (num/T, dim) holds rows [start, start + num/T).

    ``(…) int64 -> (…, dim)`` replicated: each rank looks up the ids it owns, zeros the others, and
    one all-reduce sums the lookups.
    """

    def __init__(self, weight: nn.Parameter, vocab_start: int, group: comm.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.vocab_start, self.group = weight, vocab_start, group

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: comm.ProcessGroup) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (plain lookups only: no padding_idx, max_norm or sparse)."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError(f"{embedding}: vocabulary-parallel embeddings support plain lookups only")
        start, length = _split(embedding.num_embeddings, group, f"num_embeddings of {embedding}")
        return cls(_shard(embedding.weight, 0, start, length), start, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(…) int64 -> (…, dim)."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(out, self.group)


def _parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), child


def _partition_dim(style: str, attr: str) -> int | None:
    """The dimension of parameter ``attr`` that ``style`` splits; ``None``: kept whole."""
    if style in ("replicate", *_SEQUENCE_STYLES) or (style == "row" and attr == "bias"):
        return None
    return 1 if style == "row" else 0


def _ties(root: nn.Module, chosen: Mapping[str, str]) -> list[list[tuple[str, str]]]:
    """(module name, attribute) of the holders of every Parameter that several modules share and the
    plan splits. Raises ``ValueError`` unless all holders split it the same way: one shard keeps the tie."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for name, mod in root.named_modules():
        for attr, param in mod.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((name, attr))
    ties = []
    for users in holders.values():
        dims = {_partition_dim(chosen.get(name, "replicate"), attr) for name, attr in users}
        if len(users) < 2 or dims == {None}:
            continue
        if len(dims) > 1:
            described = ", ".join(f"{name}.{attr} ({chosen.get(name, 'replicate')!r})" for name, attr in users)
            raise ValueError(
                f"{described} are one Parameter (tied weights), but the plan does not split all of them along "
                f"the same dimension, which would untie them. Split every holder alike ('vocab' for the "
                f"Embedding and 'column' for the Linear head both split the vocabulary; feed the head's sharded "
                f"logits to vocab_parallel_cross_entropy), or plan all of them as 'replicate'."
            )
        ties.append(users)
    return ties


def _retie(root: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Point every holder of a split tied Parameter at the first holder's shard (all shards are equal:
    the same rows of the same tensor), so the pair stays one Parameter with one gradient."""
    for (first, attr), *rest in ties:
        shared = getattr(root.get_submodule(first), attr)
        for name, other in rest:
            setattr(root.get_submodule(name), other, shared)


def _check_fits(module: nn.Module, style: str, name: str) -> None:
    if style in _SEQUENCE_STYLES:
        return  # any module
    expected = nn.Embedding if style == "vocab" else nn.Linear
    if type(module) is not expected:
        raise ValueError(
            f"plan asks {style!r} for {name}, a {type(module).__name__}; {style!r} applies to nn.{expected.__name__}"
        )


def _convert(module: nn.Module, style: str, group: comm.ProcessGroup, sequence_parallel: bool) -> nn.Module:
    """The module that replaces ``module`` (the same one, with hooks, for the sequence styles);
    ``_check_fits`` has already matched the module's class to ``style`` (the asserts narrow the type)."""
    if style == "column":
        assert isinstance(module, nn.Linear)
        return ColumnParallelLinear.from_linear(module, group, sequence_parallel=sequence_parallel)
    if style == "row":
        assert isinstance(module, nn.Linear)
        return RowParallelLinear.from_linear(module, group, sequence_parallel=sequence_parallel)
    if style == "sequence":
        sequence.sequence_region(module, group)
        return module
    if style == "sequence_scatter":
        sequence.scatter_output(module, group)
        return module
    assert isinstance(module, nn.Embedding)
    return VocabParallelEmbedding.from_embedding(module, group)


def _chosen(module: nn.Module, plan: Mapping[str, str], sequence_parallel: bool) -> dict[str, str]:
    """name -> style of the modules ``plan`` acts on (the first matching pattern decides)."""
    names = [name for name, _ in module.named_modules() if name]
    chosen = {name: next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), "replicate") for name in names}
    idle = ("replicate",) if sequence_parallel else ("replicate", *_SEQUENCE_STYLES)
    return {name: style for name, style in chosen.items() if style not in idle}


def check_plan(module: nn.Module, plan: Mapping[str, str], sequence_parallel: bool = False) -> dict[str, str]:
    """Validate ``plan`` against ``module`` (no communication) and return the modules it splits:
    name -> style. Raises ``ValueError`` for an unknown style, a pattern that matches nothing, or
    ``sequence_parallel`` without a ``"sequence_scatter"`` module. A pipeline checks the plan against
    the whole model before keeping its stage (whose modules a pattern may then miss)."""
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor-parallel plan: {pattern!r} -> {style!r}; styles are {STYLES}")
    names = [name for name, _ in module.named_modules() if name]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(
                f"tensor-parallel plan pattern {pattern!r} matches no module of {type(module).__name__} "
                f"(names look like {names[:4]}); patterns are relative to the module the plan is applied to"
            )
    chosen = _chosen(module, plan, sequence_parallel)
    if sequence_parallel and "sequence_scatter" not in chosen.values():
        raise ValueError(
            "sequence_parallel=True needs the plan to name where the sequence is split: the module whose "
            "output enters the first column-parallel layer (e.g. the embedding: {'embed': 'sequence_scatter'}), "
            "and the LayerNorms between row- and column-parallel layers as 'sequence'"
        )
    return chosen


def apply_tensor_parallel(
    module: nn.Module,
    plan: Mapping[str, str],
    group: comm.ProcessGroup,
    sequence_parallel: bool = False,
    check: bool = True,
) -> list[str]:
    """Split the modules of an existing ``module`` in place as ``plan`` says; returns the converted names.

    Args:
        module: the model, built whole and equal on every rank of ``group`` (same seed, or broadcast).
        plan: module-name pattern (``fnmatch``, e.g. ``"h.*.attn.c_attn"``) -> one of :data:`STYLES`;
            the first matching pattern decides. Every pattern must match at least one module.
        group: the tensor-parallel group.
        sequence_parallel: Megatron sequence parallelism (:mod:`~lightning_zero.parallel.sequence`):
            column-parallel layers all-gather their input along the sequence, row-parallel ones
            reduce-scatter their output, ``"sequence"`` modules sum their parameters' gradients over
            the group, and the output of the ``"sequence_scatter"`` module (which the plan must name)
            is split along the sequence. Without it the two sequence styles mean ``"replicate"``.
        check: validate the plan against ``module`` first (:func:`check_plan`); ``False`` for one
            pipeline stage of a model whose whole plan was checked before the split.

    Converted modules are replaced (new Parameters holding this rank's shard), so build the
    optimizer afterwards. A Parameter tied between modules that are all split along the same
    dimension of it (the token embedding as ``"vocab"`` and the LM head as ``"column"``) becomes one
    shard Parameter shared by the converted modules: the tie is kept. With a one-rank group nothing
    changes. Raises ``ValueError`` for an unknown style, a pattern that matches nothing, a style that
    does not fit the module, sizes not divisible by the group size, or tied weights that the plan
    splits differently (or splits in one holder and replicates in another).
    """
    chosen = check_plan(module, plan, sequence_parallel) if check else _chosen(module, plan, sequence_parallel)
    for name, style in chosen.items():  # every check before the first split, also with one rank
        _check_fits(module.get_submodule(name), style, name)
    ties = _ties(module, chosen)
    if comm.world_size(group) == 1:
        return []
    for name, style in chosen.items():
        parent, child = _parent(module, name)
        setattr(parent, child, _convert(module.get_submodule(name), style, group, sequence_parallel))
    _retie(module, ties)
    return list(chosen)
