"""The full checkpoint format of the Trainer strategy (``state_dict_type="full"``) during training:
every rank's pieces (what a sharded save would write into its rank file) gathered in memory to
global rank 0, which assembles Lightning's one plain checkpoint dict, as
:func:`~lightning_zero.checkpoint.consolidate.to_lightning_checkpoint` does from a directory.

Nothing is staged on disk: rank 0 writes the one file with one ``torch.save``, as DDP does, and the
other ranks write nothing (code that counts or wraps ``torch.save``, or lists the checkpoint
directory while the save runs, sees what it sees under DDP). Rank 0 holds the whole checkpoint in
host memory while it writes, as the consolidation from a directory does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.checkpoint.agreement import agree, guarded
from lightning_zero.checkpoint.consolidate import assemble
from lightning_zero.checkpoint.lightning_dict import lightning_state
from lightning_zero.checkpoint.merge import Placement, merge_reports
from lightning_zero.checkpoint.pieces import overrides, rank_payload, rank_report
from lightning_zero.checkpoint.reader import ShardedReader

if TYPE_CHECKING:
    from lightning_zero.layout import ParallelLayout
    from lightning_zero.zero import ZeroEngine


@dataclass(frozen=True)
class _Packed:
    """A tensor as raw bytes for a gathered object: pickling a tensor itself goes through
    ``torch.save`` once per storage (seen by code that wraps ``torch.save``, and it would unpickle a
    device tensor onto rank 0's device of the sender's index)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Packed:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        return cls(tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy().tobytes())

    def unpack(self) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.shape)


def _pack(value: Any) -> Any:
    if torch.is_tensor(value):
        return _Packed.of(value)
    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_pack(v) for v in value)
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, _Packed):
        return value.unpack()
    if isinstance(value, dict):
        return {k: _unpack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unpack(v) for v in value)
    return value


def gather_full(
    checkpoint: dict[str, Any],
    path: Any,
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    layout: ParallelLayout | None = None,
) -> dict[str, Any] | None:
    """Lightning's whole checkpoint (model, consolidated optimizer states, Lightning's state) on global
    rank 0, ``None`` on the other ranks. ``checkpoint`` is Lightning's dict as the strategy gives it to
    a sharded save (``path`` names the checkpoint in messages). A failure on any rank raises on rank 0
    (the caller reports rank 0's outcome to every rank). Call on all ranks."""
    group = None  # the whole world: under tensor/pipeline parallelism the engine's group is a part of it
    placement = Placement.of(comm.rank(group), comm.world_size(group), layout)
    reports = agree(
        guarded(lambda: rank_report(module, engine, optimizers, placement)), group, f"starting the save of {path}"
    )
    merged = merge_reports(reports)
    has_optimizer_states = "optimizer_states" in checkpoint

    def payload() -> dict[str, Any]:
        replaced = overrides(checkpoint["state_dict"], module, engine)  # an EMA's weights, put there by its callback
        values, optim = rank_payload(module, engine, optimizers, merged, placement.rank, replaced)
        return _pack({"params": values, "optim": optim if has_optimizer_states else []})

    gathered = comm.gather_object(guarded(payload), 0, group)
    if gathered is None:
        return None
    failed = [(r, message) for r, (ok, message) in enumerate(gathered) if not ok]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"collecting the pieces of {path} failed on rank {rank}:\n{message}")
    state = lightning_state(checkpoint, merged)
    meta = {"params": merged["params"], "state_dict_keys": merged["state_dict_keys"]}
    reader = ShardedReader.in_memory(path, meta, state.get("state_dict", {}), [_unpack(data) for _, data in gathered])
    return assemble(reader, state)
