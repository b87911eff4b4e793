"""The engine seen per parameter: which piece of which named parameter lies in this rank's slices.

Reads only the engine's public attributes (``engine.buffers``, ``engine.frozen``, ``buffer.params``, ``buffer.layout``,
``buffer.shards``, ``buffer.master``, ``engine.find(optimizer).optimizer``), which stage 3 keeps: every
trainable partitioned parameter lives in exactly one flat buffer. Values are never taken from
``module.state_dict()`` for partitioned parameters (under stage 3 they exist whole only inside
forward and backward); the tensors ZeRO does not partition (frozen parameters, buffers) are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import nn

if TYPE_CHECKING:
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
    optimizer: Optional[int]
    """Index of its optimizer in the strategy's optimizer list; ``None`` for a frozen parameter that
    stage 3 partitions without an optimizer."""
    buffer: "FlatBuffer"
    slot: int
    """Its index in ``buffer.layout.slots`` and ``buffer.params``."""

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(rank, param_offset, numel)`` of its piece on every rank that holds one."""
        layout = self.buffer.layout
        out = []
        for rank in range(layout.world_size):
            out.extend((rank, s.param_offset, s.numel) for s in layout.shards(rank) if s.param_index == self.slot)
        return out

    def local_piece(self) -> Optional[tuple[int, int, int]]:
        """``(param_offset, shard_offset, numel)`` of its piece in this rank's slice, if any."""
        for s in self.buffer.shards:
            if s.param_index == self.slot:
                return s.param_offset, s.shard_offset, s.numel
        return None


def all_buffers(engine: "ZeroEngine") -> list["FlatBuffer"]:
    """The engine's flat buffers: those of its optimizers, then (stage 3) those of frozen parameters."""
    return list(engine.buffers) + list(getattr(engine, "frozen", []))


def partitioned_params(
    module: nn.Module, engine: Optional["ZeroEngine"], optimizers: list[torch.optim.Optimizer]
) -> dict[str, PartitionedParam]:
    """Every parameter in the engine's flat buffers, by name, in the engine's buffer order (under
    stage 3 also frozen parameters, which are partitioned without an optimizer)."""
    if engine is None:
        return {}
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    optimizer_of: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        sharded = engine.find(optimizer)
        if sharded is not None:
            optimizer_of.update({id(b): index for b in sharded.buffers})
    out: dict[str, PartitionedParam] = {}
    for buffer in all_buffers(engine):
        for slot_index, (param, slot) in enumerate(zip(buffer.params, buffer.layout.slots)):
            first, *rest = names[id(param)]
            dtype, optimizer = buffer.param_shard.dtype, optimizer_of.get(id(buffer))
            out[first] = PartitionedParam(first, tuple(rest), slot.shape, dtype, optimizer, buffer, slot_index)
    return out


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


def is_slice_state(value: Any, buffer: "FlatBuffer") -> bool:
    """True for an optimizer state with one element per master element (``exp_avg``), not a scalar (``step``)."""
    return torch.is_tensor(value) and value.shape == buffer.master.shape


def local_shards(
    params: dict[str, PartitionedParam], engine: "ZeroEngine", optimizers: list[torch.optim.Optimizer]
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
