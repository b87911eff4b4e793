"""Loading a checkpoint into a ZeRO run, resharding on the way: any world size, bucket size or stage.

Each rank reads, for each piece in its own slices, the overlapping pieces that the writing ranks
saved (see :mod:`~lightning_zero.checkpoint.format`); nothing is exchanged but the final publish
(stages 1/2 all-gather the loaded master slices into the full parameters, as after a step). A plain
Lightning checkpoint (DDP, single device, or our earlier consolidated format) loads through the
same code with the whole tensors as the source.

Lightning calls, after the strategy's setup (``restore_checkpoint_after_setup`` is True, so the
engine exists): ``load_checkpoint`` (Lightning's own state; this rank's random states),
``load_model_state_dict``, then, when fitting, ``load_optimizer_state_dict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch
from torch import nn

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint import rng
from lightning_zero.checkpoint.pieces import (
    PartitionedParam,
    all_buffers,
    iter_local_pieces,
    non_partitioned_state_dict,
    partitioned_params,
)
from lightning_zero.checkpoint.save import SHARDED_OPTIMIZER_MARKER

if TYPE_CHECKING:
    from lightning_zero.zero.engine import ZeroEngine

SHARDED_KEY = "lightning_zero_sharded_checkpoint"
"""Key of the checkpoint dict that :func:`load_checkpoint` returns for a sharded checkpoint: its directory."""


class ShardedReader:
    """Reads a sharded checkpoint by state-dict key: whole tensors or ranges of flattened ones."""

    def __init__(self, path: Path, state_dict: Mapping[str, Any]) -> None:
        self.path = path
        self.meta = fmt.read_metadata(path)
        fmt.check_rank_files(path, self.meta)
        self.state_dict = state_dict
        self.params = self.meta["params"]
        self._primary = {key: name for name, e in self.params.items() for key in (name, *e["aliases"])}
        self._files: dict[int, Any] = {}

    def name_of(self, key: str) -> str:
        """The saved parameter that state-dict key ``key`` (a name or a tied alias) refers to."""
        return self._primary[key]

    def keys(self) -> list[str]:
        return list(self._primary) + [k for k in self.state_dict if k not in self._primary]

    def shape(self, key: str) -> Optional[torch.Size]:
        if key in self._primary:
            return torch.Size(self.params[self._primary[key]]["shape"])
        value = self.state_dict[key]
        return value.shape if torch.is_tensor(value) else None

    def rank_data(self, rank: int) -> Any:
        if rank not in self._files:
            self._files[rank] = fmt.load_file(self.path / self.meta["rank_files"][rank])
        return self._files[rank]

    def read(self, key: str, start: int, numel: int, state_key: Optional[str] = None) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened parameter ``key`` (or of its optimizer
        state ``state_key``), as saved (the master dtype). Opens only the rank files that overlap."""
        if key not in self._primary:
            return self.state_dict[key].reshape(-1)[start : start + numel]
        name = self._primary[key]
        entry = self.params[name]
        out = torch.empty(numel, dtype=fmt.dtype_from_name(entry["saved_dtype"]))
        for rank, offset, count in entry["pieces"]:
            lo, hi = max(start, offset), min(start + numel, offset + count)
            if lo >= hi:
                continue
            data = self.rank_data(rank)
            if state_key is None:
                piece = data["params"][name]
            else:
                piece = data["optim"][entry["optimizer"]][name]["slices"][state_key]
            if out.dtype != piece.dtype:
                out = out.to(piece.dtype)
            out[lo - start : hi - start] = piece[lo - offset : hi - offset]
        return out

    def full(self, key: str) -> Any:
        """The whole value of ``key`` (a tensor of its shape, or a non-tensor entry as saved)."""
        if key not in self._primary:
            return self.state_dict[key]
        shape = self.shape(key)
        return self.read(key, 0, shape.numel()).view(shape)

    def optimizer_entry(self, key: str) -> Optional[dict[str, Any]]:
        """``{"slices": {state_key: dtype}, "scalars": {...}}`` of parameter ``key``, or None without state."""
        name = self._primary[key]
        entry = self.params[name]
        if entry["optimizer"] is None or not entry["pieces"]:
            return None
        saved = self.rank_data(entry["pieces"][0][0])["optim"]
        if not saved:
            return None
        state = saved[entry["optimizer"]].get(name)
        if state is None:
            return None
        return {"slices": {k: v.dtype for k, v in state["slices"].items()}, "scalars": state["scalars"]}


class FullReader:
    """The same interface over a plain state dict of whole tensors (DDP or single-device checkpoints)."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self.state_dict = state_dict

    def keys(self) -> list[str]:
        return list(self.state_dict)

    def shape(self, key: str) -> Optional[torch.Size]:
        value = self.state_dict[key]
        return value.shape if torch.is_tensor(value) else None

    def read(self, key: str, start: int, numel: int) -> torch.Tensor:
        return self.state_dict[key].reshape(-1)[start : start + numel]

    def full(self, key: str) -> Any:
        return self.state_dict[key]


def reader_for(checkpoint: Mapping[str, Any]) -> "ShardedReader | FullReader":
    if SHARDED_KEY in checkpoint:
        return ShardedReader(Path(checkpoint[SHARDED_KEY]), checkpoint["state_dict"])
    return FullReader(checkpoint["state_dict"])


def load_checkpoint(
    path: fmt.PathLike, weights_only: Optional[bool], rank: int, load_plain: Callable[[fmt.PathLike], dict[str, Any]]
) -> dict[str, Any]:
    """Lightning's part of the checkpoint at ``path`` (a sharded directory, or a plain file through
    ``load_plain``), and this rank's random states restored when the checkpoint has them."""
    directory = fmt.resolve(path)
    if directory is None:
        return load_plain(path)
    meta = fmt.read_metadata(directory)
    fmt.check_rank_files(directory, meta)
    # weights_only=None means torch's default (True): Lightning's state is plain containers; pass
    # weights_only=False to Trainer.fit only for a trusted checkpoint with arbitrary hyperparameters.
    checkpoint = torch.load(
        directory / fmt.LIGHTNING_FILE, map_location="cpu", weights_only=True if weights_only is None else weights_only
    )
    checkpoint[SHARDED_KEY] = str(directory)
    if rank < meta["world_size"]:
        rng.restore(fmt.load_file(directory / meta["rank_files"][rank])["rng"])
    return checkpoint


def _check_keys(reader: Any, expected: dict[str, Optional[torch.Size]], strict: bool, where: str) -> set[str]:
    """The keys to load; ``ValueError`` listing what does not match (only shapes when not ``strict``)."""
    found = {k: reader.shape(k) for k in reader.keys()}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(found[k])} vs model {tuple(expected[k])}"
        for k in set(found) & set(expected)
        if found[k] is not None and expected[k] is not None and found[k] != expected[k]
    )
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {missing[:10]}")
    if strict and unexpected:
        problems.append(f"not in the model ({len(unexpected)}): {unexpected[:10]}")
    if shapes:
        problems.append(f"shapes differ ({len(shapes)}): {shapes[:10]}")
    if problems:
        raise ValueError(
            f"the checkpoint {where} does not fit this model: " + "; ".join(problems) + ". Load it into the "
            "LightningModule that wrote it" + (" (or set model.strict_loading = False to skip missing and "
            "unexpected keys)." if not shapes else ".")
        )
    return set(found) & set(expected)


def _match(p: PartitionedParam, keys: set[str]) -> Optional[str]:
    """The checkpoint's key for ``p``: its name, or an alias (a tied weight saved under another name)."""
    return next((k for k in (p.name, *p.aliases) if k in keys), None)


def _publish(engine: "ZeroEngine") -> None:
    """Loaded master slices -> parameters (stages 1/2: all-gathered, as after a step). Call on all ranks."""
    from lightning_zero.zero.gather import publish

    buffers = all_buffers(engine)
    for buffer in buffers:
        buffer.params_from_master()  # publish() only all-gathers what the parameter slices hold
    publish(buffers, engine.group, engine.config.allgather_bucket_size)


def load_model(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    engine: Optional["ZeroEngine"],
    optimizers: list[torch.optim.Optimizer],
    strict: bool,
) -> None:
    """Load the parameters and buffers of ``checkpoint`` into ``module`` and the engine's slices.

    Partitioned parameters: each rank writes its own pieces into the fp32 ``master`` (exact when the
    checkpoint holds fp32 masters) and publishes. Everything else: ``module.load_state_dict``. Call on all ranks.
    """
    reader = reader_for(checkpoint)
    where = checkpoint.get(SHARDED_KEY, "file")
    params = partitioned_params(module, engine, optimizers)
    rest = non_partitioned_state_dict(module, params)
    expected: dict[str, Optional[torch.Size]] = {k: v.shape if torch.is_tensor(v) else None for k, v in rest.items()}
    for p in params.values():
        expected.update({key: p.shape for key in (p.name, *p.aliases)})
    keys = _check_keys(reader, expected, strict, where)
    module.load_state_dict({k: reader.full(k) for k in rest if k in keys}, strict=False)
    if engine is None:
        return
    with torch.no_grad():
        for p, param_offset, shard_offset, numel in iter_local_pieces(params):
            key = _match(p, keys)
            if key is not None:
                p.buffer.master[shard_offset : shard_offset + numel].copy_(reader.read(key, param_offset, numel))
    _publish(engine)


def _load_sharded_optimizer(
    reader: ShardedReader,
    optimizer: torch.optim.Optimizer,
    sharded: Any,
    saved: dict[str, Any],
    params: dict[str, PartitionedParam],
) -> None:
    names = {id(p.buffer.params[p.slot]): p.name for p in params.values()}
    here = [[names.get(id(param), "<frozen>") for param in group] for group in sharded.original_params]
    there = [group["param_names"] for group in saved["param_groups"]]
    if [len(g) for g in here] != [len(g) for g in there]:
        raise ValueError(
            f"the checkpoint's {saved['class']} has parameter groups of sizes {[len(g) for g in there]} but "
            f"{type(optimizer).__name__} here has {[len(g) for g in here]}; load it into the same model and "
            "configure_optimizers that wrote it."
        )
    state: dict[int, dict[str, Any]] = {}
    # Keys of Optimizer.load_state_dict are positions in the optimizer's own parameter order (group
    # by group), which under stage 3 is not the order of sharded.buffers.
    position = {id(m): k for k, m in enumerate(m for g in optimizer.param_groups for m in g["params"])}
    by_buffer = {id(b): position[id(b.master)] for b in sharded.buffers}
    keys = set(reader.keys())
    for p, param_offset, shard_offset, numel in iter_local_pieces(params):
        key = _match(p, keys)
        if id(p.buffer) not in by_buffer or key is None:
            continue
        entry = reader.optimizer_entry(key)
        if entry is None:
            continue
        # Cloned: Adam increments "step" in place, so buffers must not share one tensor.
        scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in entry["scalars"].items()}
        target = state.setdefault(by_buffer[id(p.buffer)], scalars)
        for state_key, dtype in entry["slices"].items():
            if state_key not in target:
                target[state_key] = torch.zeros(p.buffer.layout.shard_numel, dtype=dtype)
            target[state_key][shard_offset : shard_offset + numel] = reader.read(key, param_offset, numel, state_key)
    groups, start = [], 0
    for index, saved_group in enumerate(saved["param_groups"]):
        group = {k: v for k, v in saved_group.items() if k != "param_names"}
        count = len(optimizer.param_groups[index]["params"])
        group["params"] = list(range(start, start + count))
        start += count
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_optimizers(
    checkpoint: Mapping[str, Any],
    module: nn.Module,
    engine: Optional["ZeroEngine"],
    optimizers: list[torch.optim.Optimizer],
) -> None:
    """Load every optimizer's state: sharded (read per piece) or consolidated (the earlier single-file
    format, or a plain optimizer's). Call on all ranks."""
    states = checkpoint["optimizer_states"]
    if len(states) != len(optimizers):
        raise ValueError(
            f"the checkpoint has {len(states)} optimizer states but configure_optimizers returned "
            f"{len(optimizers)} optimizers."
        )
    params = partitioned_params(module, engine, optimizers)
    reader = reader_for(checkpoint)
    for optimizer, saved in zip(optimizers, states):
        sharded = engine.find(optimizer) if engine is not None else None
        if sharded is None:
            optimizer.load_state_dict(saved)
        elif saved.get("format") == SHARDED_OPTIMIZER_MARKER:
            assert isinstance(reader, ShardedReader)
            _load_sharded_optimizer(reader, sharded.optimizer, sharded, saved, params)
        else:
            engine.load_optimizer_state_dict(optimizer, saved)
    if engine is not None:
        _publish(engine)  # a consolidated state may carry fp32 masters
