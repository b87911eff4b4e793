"""Sharded checkpoint -> one plain state dict, with no process group and no GPU, one parameter at a time.

:func:`consolidate` writes the LightningModule's state dict (``model.load_state_dict(torch.load(OUT,
weights_only=True), strict=True)`` works) without ever holding more than one whole parameter:
the output is a ``torch.save`` zip archive written record by record. Its pickle (keys, shapes,
dtypes) is known from ``metadata.json`` before any value is read, so it is written first, as
``torch.save`` does, and each parameter is then assembled from the memory-mapped rank files, cast,
written and freed. Tied parameters share one storage in the output, as they do in ``torch.save``.
(This uses torch's zip writer ``torch.serialization._open_zipfile_writer``, private but the one
``torch.save`` itself uses.)

:func:`to_lightning_checkpoint` writes a whole Lightning checkpoint (model, consolidated optimizer
states, loops, schedulers...) that a DDP or single-device Trainer resumes from; it is built in memory.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, SupportsIndex

import torch

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint.io import Location
from lightning_zero.checkpoint.lightning_dict import SHARDED_OPTIMIZER_MARKER
from lightning_zero.checkpoint.reader import ShardedReader

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


Paths = fmt.PathLike | Location | Sequence[fmt.PathLike | Location]
"""One checkpoint directory, or the directories of one node-local checkpoint (one per node)."""


def _open(path: Paths, trust_pickles: bool = False) -> tuple[ShardedReader, dict[str, Any]]:
    """The reader of the checkpoint at ``path`` (or the union of several directories of one node-local
    checkpoint, :func:`~lightning_zero.checkpoint.format.union_rank_files`) and its Lightning state
    (``lightning.pt``), read with ``weights_only`` unless ``trust_pickles`` (objects such as a
    ``pathlib.Path`` in hyperparameters need full unpickling: only for a checkpoint you trust)."""
    # A str is a Sequence too: only a list or tuple is several directories (mypy cannot narrow that).
    paths: list[fmt.PathLike | Location] = list(path) if isinstance(path, (list, tuple)) else [path]  # type: ignore[list-item]
    if not paths:
        raise ValueError("no checkpoint directory given.")
    directories = []
    for one in paths:
        found = fmt.resolve(one)
        if found is None:
            raise ValueError(f"{one} is not a lightning_zero sharded checkpoint directory (a plain file, or missing).")
        directories.append(found)
    directory = directories[0]
    meta = fmt.read_metadata(directory)
    # a node-local checkpoint's directory holds its node's ranks only: check the union covers every rank
    files = fmt.union_rank_files(directories) if len(directories) > 1 or "rank_nodes" in meta else None
    state = fmt.load_file(
        directory / fmt.lightning_file(meta),
        meta.get("lightning_file_crc32"),
        "Lightning's state",
        weights_only=not trust_pickles,
    )
    return ShardedReader(directory, state.get("state_dict", {}), files), state


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    return value


class _StorageRef:
    """A storage that will be written later as record ``data/{key}``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int, produce: Callable[[], torch.Tensor]) -> None:
        self.key, self.dtype, self.numel, self.produce = key, dtype, numel, produce


def _given(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A producer of a tensor that already exists."""
    return lambda: tensor


class _TensorRef:
    """Pickles as the tensor ``torch.save`` would write for a contiguous tensor over ``storage``."""

    def __init__(self, storage: _StorageRef, shape: torch.Size) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        stride = torch.empty(self.shape, device="meta").stride()
        args: tuple[Any, ...] = (self.storage, 0, tuple(self.shape), stride, False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    """torch.save's pickler, for storages that do not exist yet (and real ones in non-tensor values)."""

    def __init__(self, file: io.BytesIO, storages: dict[str, _StorageRef]) -> None:
        super().__init__(file, protocol=2)
        self.storages = storages

    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, torch.storage.TypedStorage):  # a tensor inside a non-tensor entry (extra state)
            numel = obj._size()
            tensor = torch.empty(0, dtype=obj.dtype).set_(obj._untyped_storage, 0, (numel,), (1,))
            obj = _StorageRef(f"extra{len(self.storages)}", obj.dtype, numel, _given(tensor))
        if not isinstance(obj, _StorageRef):
            return None
        self.storages[obj.key] = obj
        storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
        return ("storage", storage_type, obj.key, "cpu", obj.numel)


def stream_save(entries: dict[str, Any], out: fmt.PathLike) -> None:
    """``torch.save(entries, out)`` where values may be :class:`_TensorRef` placeholders, whose data is
    produced, written and freed one storage at a time (see :func:`write_file` for where)."""
    storages: dict[str, _StorageRef] = {}
    data = io.BytesIO()
    _Pickler(data, storages).dump(entries)
    write_file(out, functools.partial(_write_records, data.getvalue(), storages))


def write_file(out: fmt.PathLike, write: Callable[[Any], None]) -> None:
    """Call ``write(target)`` to produce the file ``out``: locally ``target`` is a temporary name beside
    ``out``, renamed to it once complete; on another fsspec filesystem (a store, where an object
    appears whole once closed) ``target`` is the filesystem's file object for ``out``, streamed."""
    where = ckpt_io.location(out)
    if not where.local:
        with where.open("wb") as f:
            write(f)
        return
    final = where.as_path()
    final.parent.mkdir(parents=True, exist_ok=True)  # as Lightning's TorchCheckpointIO does for DDP
    tmp = final.with_name(f".{final.name}.tmp")
    write(str(tmp))
    os.replace(tmp, final)


def _write_records(pickled: bytes, storages: dict[str, _StorageRef], target: Any) -> None:
    with torch.serialization._open_zipfile_writer(target) as writer:
        writer.write_record("data.pkl", pickled, len(pickled))
        writer.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for ref in storages.values():
            tensor = ref.produce().to(ref.dtype).contiguous()
            assert tensor.numel() == ref.numel, (ref.key, tensor.numel(), ref.numel)
            storage = tensor.untyped_storage()
            if tensor.storage_offset() != 0 or storage.nbytes() != tensor.nbytes:
                # A view into a larger storage: written by storage (torch deprecated writing by data
                # pointer), so only the view's bytes are copied out, this tensor alone at a time.
                storage = tensor.clone().untyped_storage()
            writer.write_record(f"data/{ref.key}", storage, tensor.nbytes)
            del tensor, storage


def consolidate(
    checkpoint_dir: Paths,
    out: fmt.PathLike,
    dtype: torch.dtype | None = torch.float32,
    trust_pickles: bool = False,
) -> None:
    """Write the LightningModule's whole state dict from a sharded checkpoint to ``out`` (``torch.save``
    format), one parameter in memory at a time. Floating tensors are cast to ``dtype`` (``None``: as
    saved, i.e. the fp32 masters under mixed precision). No process group or GPU needed. Every file
    is checked against the CRC-32 recorded at save. ``trust_pickles``: see :func:`_open`.

    ``checkpoint_dir`` may be a list: the directories of one node-local checkpoint, one per node
    (``node_local_storage=True``), read as their union; every rank's file must be in exactly one of
    them (``ValueError`` naming the missing or repeated ranks)."""
    reader, _ = _open(checkpoint_dir, trust_pickles)
    keys = reader.meta.get("state_dict_keys") or reader.keys()
    entries: dict[str, Any] = {}
    by_name: dict[str, _TensorRef] = {}
    counter = iter(range(len(keys)))
    for key in keys:
        if key in reader.state_dict:
            value = reader.state_dict[key]
            if torch.is_tensor(value):
                target = dtype if dtype is not None and value.is_floating_point() else value.dtype
                ref = _StorageRef(str(next(counter)), target, value.numel(), _given(value))
                entries[key] = _TensorRef(ref, value.shape)
            else:
                entries[key] = value
            continue
        name = reader.name_of(key)
        if name not in by_name:
            saved = fmt.dtype_from_name(reader.params[name]["saved_dtype"])
            shape = torch.Size(reader.params[name]["shape"])
            ref = _StorageRef(str(next(counter)), dtype or saved, shape.numel(), functools.partial(reader.full, name))
            by_name[name] = _TensorRef(ref, shape)
        entries[key] = by_name[name]
    stream_save(entries, out)


def to_lightning_checkpoint(
    checkpoint_dir: Paths,
    out: fmt.PathLike,
    dtype: torch.dtype | None = None,
    trust_pickles: bool = False,
) -> None:
    """Write a plain Lightning checkpoint (one file) from a sharded one: the whole model, consolidated
    optimizer states (per original parameter, full shapes, as the optimizer without ZeRO writes them),
    and Lightning's state. A DDP or single-device Trainer resumes from it. Built in memory.
    ``checkpoint_dir`` as for :func:`consolidate` (several node-local directories too);
    ``trust_pickles``: see :func:`_open`."""
    checkpoint = full_checkpoint(checkpoint_dir, dtype, trust_pickles)
    write_file(out, functools.partial(torch.save, checkpoint))


def full_checkpoint(checkpoint_dir: Paths, dtype: torch.dtype | None = None, trust_pickles: bool = False) -> dict:
    """What :func:`to_lightning_checkpoint` writes, in memory (the whole model and optimizer states)."""
    reader, checkpoint = _open(checkpoint_dir, trust_pickles)
    return assemble(reader, checkpoint, dtype)


def assemble(reader: ShardedReader, checkpoint: dict[str, Any], dtype: torch.dtype | None = None) -> dict:
    """Lightning's whole checkpoint from a sharded one's ``reader`` (rank files on disk or gathered in
    memory) and its Lightning state ``checkpoint`` (completed in place and returned)."""
    keys = reader.meta.get("state_dict_keys") or reader.keys()
    checkpoint["state_dict"] = {k: _cast(reader.full(k), dtype) for k in keys}
    states = []
    for o_index, saved in enumerate(checkpoint.get("optimizer_states", [])):
        if saved.get("format") != SHARDED_OPTIMIZER_MARKER:
            states.append(saved)
            continue
        per_param: dict[int, dict[str, Any]] = {}
        groups, index = [], 0
        for group in saved["param_groups"]:
            entry = {k: v for k, v in group.items() if k != "param_names"}
            entry["params"] = list(range(index, index + len(group["param_names"])))
            for name in group["param_names"]:
                found = (
                    reader.has(name) and reader.primary(name) in reader.params and reader.optimizer_entry(name, o_index)
                )
                if found:
                    # this optimizer's own state (a parameter several optimizers hold has one per optimizer)
                    state = {k: reader.full(name, state_key=k, optimizer=o_index) for k in found["slices"]}
                    # Cloned: pieces of one flat buffer share one "step" tensor, which Adam
                    # increments in place, once per parameter.
                    scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in found["scalars"].items()}
                    per_param[index] = {**state, **scalars}
                index += 1
            groups.append(entry)
        states.append({"state": per_param, "param_groups": groups})
    if "optimizer_states" in checkpoint:  # a weights-only save (ModelCheckpoint(save_weights_only=True)) has none
        checkpoint["optimizer_states"] = states
    return checkpoint


def load_from_checkpoint(cls: Any, checkpoint_path: fmt.PathLike, trust_pickles: bool = False, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` that also takes a sharded checkpoint
    directory (Lightning's own opens the path as one file and raises ``IsADirectoryError``): the
    directory is consolidated into a temporary plain Lightning checkpoint (in memory one parameter
    and the optimizer states at a time, see :func:`to_lightning_checkpoint`), which Lightning then
    loads as usual (hyperparameters, ``strict``, ``map_location``). A plain file goes straight to
    Lightning. ``trust_pickles``: hyperparameters that need full unpickling (pass
    ``weights_only=False`` in ``kwargs`` too)."""
    directory = fmt.resolve(checkpoint_path)
    if directory is None:
        return cls.load_from_checkpoint(checkpoint_path, **kwargs)
    with tempfile.TemporaryDirectory(prefix="lightning-zero-load-") as tmp:
        plain = Path(tmp) / "checkpoint.ckpt"
        to_lightning_checkpoint(directory, plain, trust_pickles=trust_pickles)
        return cls.load_from_checkpoint(plain, **kwargs)
