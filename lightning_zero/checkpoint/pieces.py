"""The engine seen per parameter: which piece of which named parameter lies in this rank's slices.

Reads the engine only through its surface (:meth:`~lightning_zero.zero.engine.ZeroEngine.held_params`,
``local_pieces``, ``param_groups``; the records of :mod:`lightning_zero.zero.surface`), and gives
each held parameter its state-dict names: every trainable partitioned parameter lives in exactly
one flat buffer, stage 3 included. Values are never taken from
``module.state_dict()`` for partitioned parameters (under stage 3 they exist whole only inside
forward and backward); the tensors ZeRO does not partition (frozen parameters, buffers) are, and
only data-parallel rank 0 saves them (and, at resume, reads them: see :func:`rank_report`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.checkpoint import format as fmt
from lightning_zero.parallel.tensor import is_tensor_parallel
from lightning_zero.zero import HeldParam, placeholders_allowed

TIED_NAMES = "tied_names"
"""Attribute a pipeline stage may set on a parameter tied to one held by another stage: the other
state-dict names of the same weight, so that a checkpoint stores it once and resolves every name."""

if TYPE_CHECKING:
    from lightning_zero.checkpoint.merge import Placement
    from lightning_zero.zero import ZeroEngine


@dataclass(frozen=True)
class PartitionedParam:
    """One parameter held in the engine's flat buffers, with its state-dict names."""

    name: str
    """Its first name in ``module.named_parameters()``."""
    aliases: tuple[str, ...]
    """Further names of the same Parameter (tied weights); all are keys of the state dict."""
    held: HeldParam
    """What the engine says of it: shape, dtypes, optimizer, pieces."""
    index: int
    """Its position in ``engine.held_params()`` (and ``engine.local_pieces()``)."""
    partition_dim: int | None = None
    """The dim along which tensor parallelism split it (``param.partition_dim``), ``None`` when whole."""

    @property
    def shape(self) -> torch.Size:
        return self.held.shape

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (of the parameter in the module)."""
        return self.held.dtype

    @property
    def optimizer(self) -> int | None:
        """Index of its optimizer in the strategy's optimizer list; ``None`` for a frozen parameter
        that stage 3 partitions without an optimizer."""
        return self.held.optimizer

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(rank, param_offset, numel)`` of its piece on every rank that holds one."""
        return list(self.held.pieces)

    def local_piece(self) -> tuple[int, int, int] | None:
        """``(param_offset, shard_offset, numel)`` of its piece in this rank's slice, if any."""
        return self.held.local


def partitioned_params(module: nn.Module, engine: ZeroEngine | None) -> dict[str, PartitionedParam]:
    """Every parameter in the engine's flat buffers, by name, in the engine's buffer order (under
    stage 3 also frozen parameters, which are partitioned without an optimizer). The engine's
    optimizer indices are the strategy's: it is built with the strategy's optimizer list."""
    if engine is None:
        return {}
    names = tensor_names(module)
    out: dict[str, PartitionedParam] = {}
    for index, held in enumerate(engine.held_params()):
        first, *rest = names[id(held.param)]
        dim = getattr(held.param, "partition_dim", None) if is_tensor_parallel(held.param) else None
        out[first] = PartitionedParam(first, tuple(rest), held, index, dim)
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


def param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its first state-dict name`` (the name checkpoints use for it)."""
    return {key: names[0] for key, names in tensor_names(module).items()}


def state_dict_keys(params: dict[str, PartitionedParam]) -> set[str]:
    """Every state-dict key of the partitioned parameters (names and aliases)."""
    return {key for p in params.values() for key in (p.name, *p.aliases)}


def non_partitioned_state_dict(module: nn.Module, params: dict[str, PartitionedParam]) -> dict[str, Any]:
    """``module.state_dict()`` without the partitioned parameters (frozen parameters, buffers, extra state)."""
    skip = state_dict_keys(params)
    with placeholders_allowed():  # the partitioned ones are skipped: they come from the shards
        return {k: v for k, v in module.state_dict().items() if k not in skip}


def module_state_dict(module: nn.Module, engine: ZeroEngine | None, stage: int, full: bool = False) -> dict[str, Any]:
    """What a checkpoint's ``state_dict`` holds: stages 1/2 the module's whole state dict (views of
    the parameters, no copy); stage 3 only the tensors ZeRO does not partition (frozen parameters,
    buffers), the partitioned ones being written from every rank's slices. Local. Stage 3 with
    ``full`` (a "full" checkpoint, as FSDP's full state dict): on global rank 0 the whole state dict,
    the partitioned parameters gathered (in the saved dtype, into its host memory), so that
    callbacks that keep it elsewhere in the checkpoint (an EMA's ``current_model_state``) keep
    every weight, as under DDP; a collective then (call on all ranks)."""
    if stage < 3:
        return module.state_dict()
    params = partitioned_params(module, engine)
    out = non_partitioned_state_dict(module, params)
    if full and engine is not None:
        whole = engine.full_params(keep=comm.rank(None) == 0)
        for p in params.values():
            if id(p.held.param) in whole:
                out.update(dict.fromkeys((p.name, *p.aliases), whole[id(p.held.param)]))
    return out


def saved_positions(engine: ZeroEngine | None, optimizers: list[torch.optim.Optimizer]) -> dict[int, int]:
    """``engine's optimizer index -> position in optimizers`` for the optimizers a save holds: a
    checkpoint numbers optimizer states by their position in the save (its ``optimizer_states``),
    which is the engine's numbering only when every optimizer is saved, in the engine's order (a
    model-only or optimizer-subset save is neither)."""
    if engine is None:
        return {}
    out: dict[int, int] = {}
    for position, optimizer in enumerate(optimizers):
        index = engine.optimizer_index(optimizer)
        if index is not None:
            out[index] = position
    return out


def local_shards(
    params: dict[str, PartitionedParam],
    engine: ZeroEngine,
    optimizers: list[torch.optim.Optimizer],
    views: bool = False,
) -> tuple[dict[str, torch.Tensor], list[dict[str, dict[str, Any]]]]:
    """This rank's pieces: ``({name: master piece}, [{name: {"slices": {key: piece}, "scalars": {key: value}}}
    per optimizer of optimizers])``; ``slices`` are states with one element per parameter element
    (``exp_avg``), ``scalars`` the others (``step``). The states of the engine's optimizers that are
    not in ``optimizers`` (a model-only save) are left out.

    Pieces are views of one CPU copy per flat buffer, so each buffer is written once. ``views``:
    of the engine's tensors where they are, for their sizes only (see ``engine.local_pieces``).
    """
    local = engine.local_pieces(views)
    position = saved_positions(engine, optimizers)
    values: dict[str, torch.Tensor] = {}
    optim: list[dict[str, dict[str, Any]]] = [{} for _ in optimizers]
    for p in params.values():
        piece = local[p.index]
        if piece is None:
            continue
        values[p.name] = piece.master
        for o_index, state in piece.states.items():  # several for a parameter several optimizers hold
            if o_index in position:
                optim[position[o_index]][p.name] = {"slices": state.slices, "scalars": state.scalars}
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
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    placement: Placement,
    copies: bool = False,
) -> dict[str, Any]:
    """What this rank holds, for :func:`~lightning_zero.checkpoint.merge.merge_reports`. Local, no communication.

    Partitioned parameters: this rank's piece of its shard (a replicated parameter only on
    tensor-parallel rank 0). Other tensors of the state dict (frozen parameters, buffers): whole,
    on data-parallel rank 0 only (they are equal over the data-parallel group); with ``copies``
    (node-local storage) the other data-parallel ranks offer theirs under ``"copies"`` (``{key:
    piece}``), of which :func:`~lightning_zero.checkpoint.merge.keep_copies` keeps one per node. At
    resume those whole tensors are read by data-parallel rank 0 alone, which broadcasts them over its
    data-parallel group (:func:`~lightning_zero.checkpoint.load.load_model`).
    """
    params = partitioned_params(module, engine)
    rank, coords = placement.rank, placement.coords
    position = saved_positions(engine, optimizers)
    entries: dict[str, dict[str, Any]] = {}
    for p in params.values():
        saved = [position[o] for o in p.held.optimizers if o in position]
        split = placement.split(p.partition_dim)
        if split is None and coords.tp != 0:
            continue
        local = p.local_piece()
        piece = None if local is None else [rank, coords.tp if split else 0, local[0], local[2]]
        entries[p.name] = _entry(
            [p.name, *p.aliases],
            p.shape,
            p.partition_dim,
            placement,
            dtype=fmt.dtype_name(p.dtype),
            saved_dtype=fmt.dtype_name(p.held.saved_dtype),
            # positions in this save's optimizer_states (None: frozen, or its optimizer is not saved)
            optimizer=saved[0] if saved else None,
            piece=piece,
            # only for a parameter several optimizers hold (each has its state under its index in "optim")
            **({"optimizers": saved} if len(saved) > 1 else {}),
        )
    names = tensor_names(module)
    skip = state_dict_keys(params)
    offered: dict[str, list[int]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(tensor) or key in skip or names[id(tensor)][0] != key or (coords.dp and not copies):
            continue
        dim = getattr(tensor, "partition_dim", None) if is_tensor_parallel(tensor) else None
        split = placement.split(dim)
        if split is None and coords.tp != 0:
            continue
        dtype = fmt.dtype_name(tensor.dtype)
        piece = [rank, coords.tp if split else 0, 0, tensor.numel()]
        if coords.dp:
            offered[key] = piece
            continue
        entries[key] = _entry(
            names[id(tensor)], tensor.shape, dim, placement, dtype=dtype, saved_dtype=dtype, optimizer=None, piece=piece
        )
    return {
        "rank": rank,
        "pp_rank": coords.pp,
        "state_dict_keys": list(module.state_dict(keep_vars=True).keys()),
        "params": entries,
        "optimizer_names": [_group_names(module, engine, o) for o in optimizers],
        **({"copies": offered} if copies else {}),
    }


def _group_names(
    module: nn.Module, engine: ZeroEngine | None, optimizer: torch.optim.Optimizer
) -> list[list[str]] | None:
    if engine is None or not engine.manages(optimizer):
        return None
    names = param_names(module)
    return [[names[id(p)] for p in group.params if id(p) in names] for group in engine.param_groups(optimizer)]


def overrides(state_dict: dict[str, Any], module: nn.Module, engine: ZeroEngine | None) -> dict[str, torch.Tensor]:
    """The entries of ``checkpoint["state_dict"]`` that hooks or callbacks replaced (an EMA callback
    puts its averaged weights there in ``on_save_checkpoint``): tensors of the module's full shape
    that are not the module's own tensor. The checkpoint stores those values, as under DDP, where
    ``checkpoint["state_dict"]`` is what is written."""
    own: dict[str, torch.Tensor] = {}
    with placeholders_allowed():
        for key, tensor in module.state_dict(keep_vars=True).items():
            if torch.is_tensor(tensor):
                own[key] = tensor
    shapes: dict[str, torch.Size] = {}
    for p in partitioned_params(module, engine).values():
        for key in (p.name, *p.aliases):
            shapes[key] = p.shape
    out = {}
    for key, value in state_dict.items():
        if not torch.is_tensor(value) or key not in own:
            continue
        mine = own[key]
        if mine.numel() > 0 and value.data_ptr() == mine.data_ptr():
            continue  # the module's own tensor (or a view of it): nothing was replaced
        if tuple(value.shape) != tuple(shapes.get(key, mine.shape)):
            raise ValueError(
                f'checkpoint["state_dict"]["{key}"] was replaced by a tensor of shape {tuple(value.shape)} in a '
                f"hook or callback, but the parameter has shape {tuple(shapes.get(key, mine.shape))}; a checkpoint "
                "can only store a value of the parameter's shape."
            )
        out[key] = value
    return out


def rank_payload(
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    merged: dict[str, Any],
    rank: int,
    replaced: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, dict[str, Any]]]]:
    """This rank's file contents (see :func:`local_shards`), keyed by the merged (primary) names:
    only the pieces that the merged metadata lists under ``rank``. ``replaced`` (see
    :func:`overrides`) gives values that take the place of the weights the engine holds."""
    params = partitioned_params(module, engine)
    mine = {
        name
        for name, e in merged["params"].items()
        if any(piece[0] == rank for piece in (*e["pieces"], *e.get("copies", ())))
    }
    alias_of = merged["alias_of"]
    values, optim = local_shards(params, engine, optimizers) if engine is not None else ({}, [{} for _ in optimizers])
    replaced = replaced or {}
    for p in params.values():
        value = next((replaced[k] for k in (p.name, *p.aliases) if k in replaced), None)
        local = p.local_piece()
        if value is not None and local is not None:
            param_offset, _, numel = local
            flat = value.detach().reshape(-1)[param_offset : param_offset + numel]
            values[p.name] = flat.to("cpu", p.held.saved_dtype, copy=True)
    values = {alias_of[n]: v for n, v in values.items() if alias_of.get(n) in mine}
    optim = [{alias_of[n]: v for n, v in o.items() if alias_of.get(n) in mine} for o in optim]
    skip = state_dict_keys(params)
    for key, tensor in module.state_dict(keep_vars=True).items():
        primary = alias_of.get(key)
        if torch.is_tensor(tensor) and key not in skip and primary in mine and primary not in values:
            tensor = replaced.get(key, tensor)
            values[primary] = tensor.detach().reshape(-1).to("cpu", copy=True)
    return values, optim
