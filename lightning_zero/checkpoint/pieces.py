"""The engine seen per parameter: which piece of which named parameter lies in this rank's slices.

Reads only the engine's public attributes (``engine.buffers``, ``engine.frozen``, ``buffer.params``, ``buffer.layout``,
``buffer.shards``, ``buffer.master``, ``engine.find(optimizer).optimizer``), which stage 3 keeps: every
trainable partitioned parameter lives in exactly one flat buffer. Values are never taken from
``module.state_dict()`` for partitioned parameters (under stage 3 they exist whole only inside
forward and backward); the tensors ZeRO does not partition (frozen parameters, buffers) are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero.checkpoint import format as fmt
from lightning_zero.parallel.tensor import is_tensor_parallel

TIED_NAMES = "tied_names"
"""Attribute a pipeline stage may set on a parameter tied to one held by another stage: the other
state-dict names of the same weight, so that a checkpoint stores it once and resolves every name."""

if TYPE_CHECKING:
    from lightning_zero.checkpoint.merge import Placement
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.flat import FlatBuffer


@dataclass(frozen=True)
class PartitionedParam:
    """One trainable parameter held in a flat buffer."""

    name: str
    """Its first name in ``module.named_parameters()``."""
    aliases: tuple[str, ...]
    """Further names of the same Parameter (tied weights); all are keys of the state dict."""
    shape: torch.Size
    dtype: torch.dtype
    """The compute dtype (of the parameter in the module)."""
    optimizer: int | None
    """Index of its optimizer in the strategy's optimizer list; ``None`` for a frozen parameter that
    stage 3 partitions without an optimizer."""
    buffer: FlatBuffer
    slot: int
    """Its index in ``buffer.layout.slots`` and ``buffer.params``."""
    partition_dim: int | None = None
    """The dim along which tensor parallelism split it (``param.partition_dim``), ``None`` when whole."""

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(rank, param_offset, numel)`` of its piece on every rank that holds one."""
        layout = self.buffer.layout
        out = []
        for rank in range(layout.world_size):
            out.extend((rank, s.param_offset, s.numel) for s in layout.shards(rank) if s.param_index == self.slot)
        return out

    def local_piece(self) -> tuple[int, int, int] | None:
        """``(param_offset, shard_offset, numel)`` of its piece in this rank's slice, if any."""
        for s in self.buffer.shards:
            if s.param_index == self.slot:
                return s.param_offset, s.shard_offset, s.numel
        return None


def all_buffers(engine: ZeroEngine) -> list[FlatBuffer]:
    """The engine's flat buffers: those of its optimizers, then (stage 3) those of frozen parameters."""
    return list(engine.buffers) + list(getattr(engine, "frozen", []))


def partitioned_params(
    module: nn.Module, engine: ZeroEngine | None, optimizers: list[torch.optim.Optimizer]
) -> dict[str, PartitionedParam]:
    """Every parameter in the engine's flat buffers, by name, in the engine's buffer order (under
    stage 3 also frozen parameters, which are partitioned without an optimizer)."""
    if engine is None:
        return {}
    names = tensor_names(module)
    optimizer_of: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        sharded = engine.find(optimizer)
        if sharded is not None:
            optimizer_of.update({id(b): index for b in sharded.buffers})
    out: dict[str, PartitionedParam] = {}
    for buffer in all_buffers(engine):
        for slot_index, (param, slot) in enumerate(zip(buffer.params, buffer.layout.slots, strict=True)):
            first, *rest = names[id(param)]
            dtype, optimizer = buffer.param_shard.dtype, optimizer_of.get(id(buffer))
            dim = getattr(param, "partition_dim", None) if is_tensor_parallel(param) else None
            out[first] = PartitionedParam(first, tuple(rest), slot.shape, dtype, optimizer, buffer, slot_index, dim)
    return out


def tensor_names(module: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> [state-dict names]`` of every parameter and buffer, tied names included, and
    the names a pipeline stage declares in ``param.tied_names`` for a weight tied to one on
    another stage (e.g. the LM head's copy of the token embedding)."""
    names: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if torch.is_tensor(tensor):
            names.setdefault(id(tensor), []).append(name)
    for name, param in module.named_parameters(remove_duplicate=False):
        known = names.setdefault(id(param), [])
        for other in (name, *getattr(param, TIED_NAMES, ())):
            if other not in known:
                known.append(other)
    return names


def state_dict_keys(params: dict[str, PartitionedParam]) -> set[str]:
    """Every state-dict key of the partitioned parameters (names and aliases)."""
    return {key for p in params.values() for key in (p.name, *p.aliases)}


def non_partitioned_state_dict(module: nn.Module, params: dict[str, PartitionedParam]) -> dict[str, Any]:
    """``module.state_dict()`` without the partitioned parameters (frozen parameters, buffers, extra state)."""
    skip = state_dict_keys(params)
    return {k: v for k, v in module.state_dict().items() if k not in skip}


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU in a storage of its own size: torch.save writes a view's whole storage,
    and without a separate master the master slice is a view of the full flat buffer."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.to("cpu", copy=True).contiguous()


def is_slice_state(value: Any, buffer: FlatBuffer) -> bool:
    """True for an optimizer state with one element per master element (``exp_avg``), not a scalar (``step``)."""
    return torch.is_tensor(value) and value.shape == buffer.master.shape


def local_shards(
    params: dict[str, PartitionedParam], engine: ZeroEngine, optimizers: list[torch.optim.Optimizer]
) -> tuple[dict[str, torch.Tensor], list[dict[str, dict[str, Any]]]]:
    """This rank's pieces: ``({name: master piece}, [{name: {"slices": {key: piece}, "scalars": {key: value}}}
    per optimizer])``; ``slices`` are states with one element per parameter element (``exp_avg``),
    ``scalars`` the others (``step``).

    Pieces are views of one CPU copy per flat buffer, so each buffer is written once.
    """
    owner = {id(b): sharded for o in optimizers if (sharded := engine.find(o)) is not None for b in sharded.buffers}
    masters: dict[int, torch.Tensor] = {}
    slices: dict[int, dict[str, torch.Tensor]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for buffer in all_buffers(engine):
        masters[id(buffer)] = _own_storage(buffer.master)
        raw = owner[id(buffer)].optimizer.state.get(buffer.master, {}) if id(buffer) in owner else {}
        slices[id(buffer)] = {k: _own_storage(v) for k, v in raw.items() if is_slice_state(v, buffer)}
        scalars[id(buffer)] = {
            k: v.detach().cpu().clone() if torch.is_tensor(v) else v
            for k, v in raw.items()
            if not is_slice_state(v, buffer)
        }
    values: dict[str, torch.Tensor] = {}
    optim: list[dict[str, dict[str, Any]]] = [{} for _ in optimizers]
    for p, _, shard_offset, numel in iter_local_pieces(params):
        window = slice(shard_offset, shard_offset + numel)
        values[p.name] = masters[id(p.buffer)][window]
        if p.optimizer is None:
            continue
        optim[p.optimizer][p.name] = {
            "slices": {k: v[window] for k, v in slices[id(p.buffer)].items()},
            "scalars": scalars[id(p.buffer)],
        }
    return values, optim


def iter_local_pieces(params: dict[str, PartitionedParam]) -> Iterator[tuple[PartitionedParam, int, int, int]]:
    """``(param, param_offset, shard_offset, numel)`` for each piece in this rank's slices."""
    for p in params.values():
        piece = p.local_piece()
        if piece is not None:
            yield (p, *piece)


def _entry(names: list[str], tensor_shape: Any, partition_dim: int | None, placement: Placement, **fields: Any) -> dict:
    split = placement.split(partition_dim)
    return {
        "names": names,
        "shape": placement.full_shape(tensor_shape, partition_dim),
        "partition_dim": None if split is None else partition_dim,
        "tensor_parallel_size": 1 if split is None else split.size,
        **fields,
    }


def rank_report(
    module: nn.Module, engine: ZeroEngine | None, optimizers: list[torch.optim.Optimizer], placement: Placement
) -> dict[str, Any]:
    """What this rank holds, for :func:`~lightning_zero.checkpoint.merge.merge_reports`. Local, no communication.

    Partitioned parameters: this rank's piece of its shard (a replicated parameter only on
    tensor-parallel rank 0). Other tensors of the state dict (frozen parameters, buffers): whole,
    on data-parallel rank 0 only (they are equal over the data-parallel group).
    """
    params = partitioned_params(module, engine, optimizers)
    rank, coords = placement.rank, placement.coords
    entries: dict[str, dict[str, Any]] = {}
    for p in params.values():
        split = placement.split(p.partition_dim)
        if split is None and coords.tp != 0:
            continue
        local = p.local_piece()
        piece = None if local is None else [rank, coords.tp if split else 0, local[0], local[2]]
        saved = fmt.dtype_name(p.buffer.master.dtype)
        entries[p.name] = _entry(
            [p.name, *p.aliases],
            p.shape,
            p.partition_dim,
            placement,
            dtype=fmt.dtype_name(p.dtype),
            saved_dtype=saved,
            optimizer=p.optimizer,
            piece=piece,
        )
    names = tensor_names(module)
    skip = state_dict_keys(params)
    for key, tensor in module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(tensor) or key in skip or names[id(tensor)][0] != key or coords.dp != 0:
            continue
        dim = getattr(tensor, "partition_dim", None) if is_tensor_parallel(tensor) else None
        split = placement.split(dim)
        if split is None and coords.tp != 0:
            continue
        dtype = fmt.dtype_name(tensor.dtype)
        piece = [rank, coords.tp if split else 0, 0, tensor.numel()]
        entries[key] = _entry(
            names[id(tensor)], tensor.shape, dim, placement, dtype=dtype, saved_dtype=dtype, optimizer=None, piece=piece
        )
    return {
        "rank": rank,
        "pp_rank": coords.pp,
        "state_dict_keys": list(module.state_dict(keep_vars=True).keys()),
        "params": entries,
        "optimizer_names": [_group_names(module, engine, o) for o in optimizers],
    }


def _group_names(
    module: nn.Module, engine: ZeroEngine | None, optimizer: torch.optim.Optimizer
) -> list[list[str]] | None:
    sharded = engine.find(optimizer) if engine is not None else None
    if sharded is None:
        return None
    names = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return [[names[id(p)] for p in group if id(p) in names] for group in sharded.original_params]


def rank_payload(
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    merged: dict[str, Any],
    rank: int,
) -> tuple[dict[str, torch.Tensor], list[dict[str, dict[str, Any]]]]:
    """This rank's file contents (see :func:`local_shards`), keyed by the merged (primary) names:
    only the pieces that the merged metadata lists under ``rank``."""
    params = partitioned_params(module, engine, optimizers)
    mine = {name for name, e in merged["params"].items() if any(piece[0] == rank for piece in e["pieces"])}
    alias_of = merged["alias_of"]
    values, optim = local_shards(params, engine, optimizers) if engine is not None else ({}, [{} for _ in optimizers])
    values = {alias_of[n]: v for n, v in values.items() if alias_of.get(n) in mine}
    optim = [{alias_of[n]: v for n, v in o.items() if alias_of.get(n) in mine} for o in optim]
    skip = state_dict_keys(params)
    for key, tensor in module.state_dict(keep_vars=True).items():
        primary = alias_of.get(key)
        if torch.is_tensor(tensor) and key not in skip and primary in mine and primary not in values:
            values[primary] = tensor.detach().reshape(-1).to("cpu", copy=True)
    return values, optim
