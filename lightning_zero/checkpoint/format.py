"""The on-disk format of a sharded checkpoint, and how a path is recognised as one.

A checkpoint is a directory (its name is the path Lightning asked for, e.g. ``epoch=3-step=400.ckpt``)::

    rank-00000.pt ... rank-0000{N-1}.pt   one per global rank (data, tensor and pipeline ranks alike),
                                          written by that rank, in parallel
    lightning.pt                          rank 0: Lightning's state (loops, callbacks, LR schedulers,
                                          hyperparameters, precision-plugin state = loss scaler),
                                          non-tensor entries of the state dict (extra state) and the
                                          optimizers' parameter-group hyperparameters and parameter names
    metadata.json                         written last: its presence marks the directory complete

Under node-local storage (:mod:`~lightning_zero.checkpoint.io`) each node's directory holds its own
ranks' files, ``lightning.pt`` and the same ``metadata.json``, which then also has ``"rank_nodes"``
(the node that wrote each rank's file) and, in the entry of each tensor ZeRO does not partition,
``"copies"``: ``[rank, tp_rank, offset, numel]`` of the same piece written again by a rank of a
node that would otherwise not have it. ``"save_id"`` (every save) tells whether directories hold one save.

On an object store (no rename, :mod:`~lightning_zero.checkpoint.store`) the rank files and
``lightning.pt`` lie under ``files-ID/`` in the directory, ``ID`` new for each save; ``rank_files``
and ``lightning_file`` in ``metadata.json`` name them relative to the directory.

The format is **per parameter**, not per flat buffer, so a checkpoint loads into another world
size, bucket size, stage, tensor-parallel size or pipeline split. Every tensor of the model's state
dict is described by its **whole** (unsplit) shape; a tensor-parallel parameter (``param.tensor_parallel``,
split along ``param.partition_dim`` into T equal parts, part t on tensor-parallel rank t) is stored
as its T parts, each flattened; any other tensor as one part. Rank r's file holds, for every part
with elements in r's slices, one contiguous piece of the flattened part::

    {"params": {name: 1-D tensor},                  the master (fp32 under mixed precision) values
     "optim":  [{name: {"slices": {state_key: 1-D tensor}, "scalars": {state_key: value}}} per optimizer],
     "rng":    this rank's torch / numpy / Python random states,
     "loader": this rank's stateful train data loader states (Lightning's ``combined_loader``; None without),
     "window": None, or (saved in the middle of a gradient-accumulation window) this rank's gradients
               accumulated since the last step, with the flat-buffer layout they belong to}

and ``metadata.json`` says where each piece starts::

    "layout": {"data": D, "tensor": T, "pipeline": P}, "world_size": D*T*P, "state_dict_keys": [...],
    "mid_window": whether the ranks' "window" entries hold gradients,
    "params": {name: {"shape": [whole shape], "dtype": "bfloat16", "saved_dtype": "float32",
                      "aliases": [tied names], "optimizer": 0 (or null: no optimizer state),
                      "partition_dim": d (or null), "tensor_parallel_size": T (1: saved whole),
                      "pieces": [[rank, tp_rank, offset, numel], ...]}}

A parameter that several optimizers hold (the same tensor in two ``configure_optimizers``
optimizers) has each one's state under that optimizer's index in ``optim`` and, in its entry,
``"optimizers": [indices]`` (``"optimizer"`` is the first of them); a reader asks for the state of
the optimizer it is loading or consolidating.

``offset`` counts elements of the flattened part ``tp_rank`` (of the whole tensor when it is not
split). Who writes what: a partitioned (ZeRO) parameter's pieces come from the data-parallel ranks
that own them; the other tensors (frozen parameters, buffers) whole from data-parallel rank 0; a
replicated (not split) tensor only from tensor-parallel rank 0. Under pipeline parallelism each rank
holds the parameters of its stage only, so ``params`` is the union of what the ranks hold, merged on
save (:mod:`~lightning_zero.checkpoint.merge`); a weight tied across stages (a token embedding and the
LM head) is stored once when its stages name each other in ``param.tied_names``, and every name of
a tied weight resolves through ``aliases``. Loading takes, for each local parameter, its part for
the reader's tensor-parallel size from the saved parts that overlap it.

Version 1 (before tensor parallelism: pieces ``[rank, offset, numel]``, tensors other than
partitioned parameters in ``lightning.pt``) is read too.

Every file is read with ``torch.load(..., weights_only=True, mmap=True)``: nothing is unpickled but
tensors and plain containers, and a piece is paged in only when read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pickle
import posixpath
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint.io import Location
from lightning_zero.ops import checksum

FORMAT_NAME = "lightning_zero.sharded_checkpoint"
FORMAT_VERSION = 2
METADATA_FILE = "metadata.json"
LIGHTNING_FILE = "lightning.pt"

PathLike = str | os.PathLike
P = TypeVar("P", Path, Location)  # a local path, or a path on any fsspec filesystem


def rank_file(rank: int) -> str:
    """Name of rank ``rank``'s shard file inside the checkpoint directory."""
    return f"rank-{rank:05d}.pt"


def _hidden(path: P, kind: str) -> P:
    # A hash, not the name itself: ModelCheckpoint finds "last" checkpoints by the substring "last"
    # in a name, and must not pick a temporary directory of "last.ckpt".
    digest = hashlib.sha1(path.name.encode()).hexdigest()[:16]
    return path.parent / f".zero-{kind}-{digest}"


def temporary_path(path: P) -> P:
    """Where a save into ``path`` is written before it is complete (hidden, so never listed as a checkpoint)."""
    return _hidden(path, "tmp")


def node_temporary_path(path: P, node: int) -> P:
    """:func:`temporary_path` of node ``node`` under node-local storage: one per node, so that nodes
    which (wrongly) share the storage find each other's directory instead of clearing it."""
    hidden = _hidden(path, "tmp")
    return hidden.parent / f"{hidden.name}-node{node}"


def previous_path(path: P) -> P:
    """Where the checkpoint being overwritten waits while the new one is renamed into place."""
    return _hidden(path, "old")


def trash_path(path: P) -> P:
    """Where a checkpoint is renamed before it is deleted, so a half-deleted one is never loaded."""
    return _hidden(path, "trash")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def is_sharded_checkpoint(path: PathLike | Location) -> bool:
    """True when ``path`` (a local path or any fsspec URL) is a complete sharded checkpoint directory."""
    return _read_format(ckpt_io.location(path)) is not None


def _read_format(path: Location) -> dict[str, Any] | None:
    marker = path / METADATA_FILE
    if path.local:
        if not (path.as_path().is_dir() and marker.as_path().is_file()):
            return None
    elif not marker.is_file():
        return None
    try:
        with marker.open("rb") as f:
            meta = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{marker} is damaged (truncated or overwritten: {exc}); the checkpoint in {path} cannot be read. "
            "Copy it again from where it was written, or resume from an earlier checkpoint."
        ) from exc
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT_NAME else None


def read_metadata(path: PathLike | Location) -> dict[str, Any]:
    """The metadata of the sharded checkpoint at ``path`` (resolved by :func:`resolve`)."""
    meta = _read_format(ckpt_io.location(path))
    if meta is None:
        raise ValueError(f"{path} is not a complete lightning_zero sharded checkpoint (no {METADATA_FILE}).")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} was written in format version {meta['version']}, newer than this lightning_zero "
            f"(reads up to {FORMAT_VERSION}); upgrade lightning_zero."
        )
    return upgrade_metadata(meta)


def upgrade_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """Version 1 metadata in the version 2 form (every parameter one whole part, ``tp_rank`` 0)."""
    if meta.get("version", FORMAT_VERSION) >= 2:
        return meta
    for entry in meta.get("params", {}).values():
        entry.setdefault("partition_dim", None)
        entry.setdefault("tensor_parallel_size", 1)
        entry["pieces"] = [[rank, 0, offset, numel] for rank, offset, numel in entry["pieces"]]
    return meta


def lightning_file(meta: dict[str, Any]) -> str:
    """Where ``lightning.pt`` is, relative to the checkpoint directory (on a store: under the save's
    ``files-ID/`` prefix, see :mod:`~lightning_zero.checkpoint.store`)."""
    return str(meta.get("lightning_file", LIGHTNING_FILE))


def write_metadata(path: PathLike | Location, meta: dict[str, Any]) -> None:
    """Write ``metadata.json`` durably (it is the completeness marker, so it goes last). On a store
    it is one object, which a reader sees whole or not at all."""
    path = ckpt_io.location(path)
    data = json.dumps(meta, indent=1).encode()
    if not path.local:
        with (path / METADATA_FILE).open("wb") as f:
            f.write(data)
        return
    with open(path.as_path() / METADATA_FILE, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def resolve(path: PathLike | Location) -> Location | None:
    """The sharded checkpoint directory that ``path`` names, or ``None`` when ``path`` is a plain file
    (or nothing).

    Raises ``ValueError`` for a file inside a checkpoint directory and for a directory (a prefix, on
    a store) that is not a complete checkpoint (a save that did not finish). When a local save
    overwriting ``path`` was killed between its two renames, the previous checkpoint is found under
    its temporary name and returned. ``path`` may be any fsspec URL
    (:func:`~lightning_zero.checkpoint.io.location`).
    """
    path = ckpt_io.location(path)
    if not path.local:
        path.refresh()  # another rank or process wrote it: no listing cached before counts
    if path.is_file():
        parent = path.parent
        if _read_format(parent) is not None or (parent / LIGHTNING_FILE).is_file():
            raise ValueError(
                f"{path} is a file inside the sharded checkpoint directory {parent}; pass the directory "
                f"itself: ckpt_path={str(parent)!r}."
            )
        return None
    if _read_format(path) is not None:
        return path
    if path.is_dir():
        raise ValueError(
            f"{path} is a directory but not a complete lightning_zero checkpoint: it has no {METADATA_FILE}, "
            "which is written last, so a save into it did not finish (or it is not a checkpoint). Load the "
            "previous checkpoint instead."
        )
    old = previous_path(path)
    if path.local and _read_format(old) is not None:
        warnings.warn(
            f"{path} does not exist, but {old} does: a save overwriting {path} was interrupted after moving "
            f"the previous checkpoint aside. Loading that previous checkpoint; rename it to {path} to keep it.",
            stacklevel=2,
        )
        return old
    return None


def check_rank_files(path: Location, meta: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every rank whose shard file is missing or truncated. On a store the
    sizes come from one listing of the checkpoint's prefix, not one request per rank file."""
    found = _sizes(path)
    problems = []
    for rank, (name, size) in enumerate(zip(meta["rank_files"], meta["rank_file_bytes"], strict=True)):
        actual = found(name)
        if actual is None:
            problems.append(f"{name} (rank {rank}) is missing")
        elif actual != size:
            problems.append(f"{name} (rank {rank}) has {actual} bytes, expected {size}")
    if problems:
        raise ValueError(
            f"the sharded checkpoint {path} written by {meta['world_size']} ranks is incomplete: "
            + "; ".join(problems)
            + ". Copy the whole checkpoint directory (every rank's file) from where it was written."
        )


def rank_node(meta: dict[str, Any], rank: int) -> int | None:
    """The node that wrote rank ``rank``'s file of a node-local checkpoint (``None``: shared storage)."""
    nodes = meta.get("rank_nodes")
    return None if nodes is None else int(nodes[rank])


def available_rank_files(path: Location, meta: dict[str, Any]) -> dict[int, Location]:
    """``{rank: its file}`` for the rank files in ``path`` with the size recorded at save.

    A shared-storage checkpoint must have all of them (``ValueError`` naming the missing ones, see
    :func:`check_rank_files`); a node-local one (``metadata.json``'s ``rank_nodes``) holds only the
    ranks of the node that wrote the directory, and a reader asks for another rank's file only when
    the layout differs (:meth:`~lightning_zero.checkpoint.reader.ShardedReader.rank_data` then names it)."""
    if meta.get("rank_nodes") is None:
        check_rank_files(path, meta)
        return {rank: path / name for rank, name in enumerate(meta["rank_files"])}
    found = _sizes(path)
    return {
        rank: path / name
        for rank, (name, size) in enumerate(zip(meta["rank_files"], meta["rank_file_bytes"], strict=True))
        if found(name) == size
    }


def union_rank_files(directories: list[Location]) -> dict[int, Location]:
    """``{rank: its file}`` over several directories of one save (a node-local checkpoint: one directory
    per node). ``ValueError`` when they hold different saves, or unless every rank's file (with the
    size recorded at save) is in exactly one of them, naming the missing and the repeated ranks."""
    metas = [read_metadata(directory) for directory in directories]
    first = metas[0]
    for directory, meta in zip(directories[1:], metas[1:], strict=True):
        if meta.get("save_id") != first.get("save_id") or meta["rank_files"] != first["rank_files"]:
            raise ValueError(
                f"{directory} and {directories[0]} hold different saves (save_id {meta.get('save_id')} vs "
                f"{first.get('save_id')}); give the directories of one checkpoint, one per node."
            )
    found: dict[int, list[Location]] = {}
    for directory in directories:
        sizes = _sizes(directory)
        for rank, (name, size) in enumerate(zip(first["rank_files"], first["rank_file_bytes"], strict=True)):
            if sizes(name) == size:
                found.setdefault(rank, []).append(directory / name)
    missing = [rank for rank in range(first["world_size"]) if rank not in found]
    repeated = {rank: [str(f) for f in files] for rank, files in found.items() if len(files) > 1}
    if missing or repeated:
        problems = []
        if missing:
            problems.append(f"the files of ranks {missing} are in none of them (missing or truncated)")
        if repeated:
            problems.append(f"ranks {sorted(repeated)} have a file in more than one: {repeated}")
        raise ValueError(
            f"the directories {[str(d) for d in directories]} do not hold each of the {first['world_size']} ranks' "
            f"files exactly once: {'; '.join(problems)}. Give every node's directory of the checkpoint, each once."
        )
    return {rank: files[0] for rank, files in found.items()}


def check_own_file(path: Location, meta: dict[str, Any], rank: int) -> None:
    """``ValueError`` naming ``rank``, the node that wrote its file and the path when this rank's file of
    the node-local checkpoint at ``path`` is missing or truncated (its CRC-32 is checked when read)."""
    name, size = meta["rank_files"][rank], meta["rank_file_bytes"][rank]
    actual = _sizes(path)(name)
    if actual == size:
        return
    state = "missing" if actual is None else f"{actual} bytes, expected {size}"
    raise ValueError(
        f"rank {rank}'s shard file {path / name} is {state}: the node-local checkpoint {path} was written by "
        f"{meta['world_size']} ranks, each on its own node's disk, and rank {rank}'s file was written by node "
        f"{rank_node(meta, rank)}. Resume with every rank on the node that wrote its file (the same nodes, world size "
        "and layout), or copy that node's file into this node's directory."
    )


def _sizes(path: Location) -> Callable[[str], int | None]:
    """The size of file ``name`` under ``path`` (``None``: no such file)."""
    if path.local:
        return lambda name: (path.as_path() / name).stat().st_size if (path.as_path() / name).is_file() else None
    path.refresh()
    listing = path.fs.find(path.path, detail=True)
    sizes = {posixpath.relpath(key, path.path): info.get("size") for key, info in listing.items()}
    return lambda name: sizes.get(name)


def crc32_of(file: Path, chunk: int = 16 << 20) -> int:
    """CRC-32 of a file's bytes, ``chunk`` bytes at a time from a memory map of it: the pages are
    those ``torch.load(mmap=True)`` maps next (the page cache), with no copy into Python buffers.
    Compiled (:mod:`lightning_zero.ops.checksum`, ~10 GB/s; zlib's ~3 GB/s without the extension)."""
    crc = 0
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return crc
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_SEQUENTIAL)  # read ahead
            view = memoryview(mapped)
            try:
                for start in range(0, size, chunk):
                    crc = checksum.crc32(view[start : start + chunk], crc)
            finally:
                view.release()
    return crc


def verify_file(file: Path, expected_crc32: int | None, what: str) -> None:
    """Raise ``ValueError`` naming ``file`` (and ``what`` wrote it) when its bytes do not have the
    CRC-32 recorded at save (``None``: a checkpoint written before checksums, not checked)."""
    if expected_crc32 is None:
        return
    actual = crc32_of(file)
    if actual != expected_crc32:
        raise ValueError(
            f"{file} ({what}) is corrupted: its CRC-32 is {actual:#010x}, the checkpoint recorded "
            f"{expected_crc32:#010x} when it was written. Copy the checkpoint again from where it was written, "
            "or resume from an earlier one."
        )


def load_file(file: Location, expected_crc32: int | None = None, what: str = "checkpoint file", **kwargs: Any) -> Any:
    """``torch.load`` of one checkpoint file: weights only, memory-mapped, onto the CPU; its CRC-32
    checked first when given. A file torch cannot read raises ``ValueError`` naming it.

    A file on another filesystem than the local one is first copied by fsspec into the local
    temporary directory (``TMPDIR``), checked, memory-mapped and unlinked (the mapping stays valid),
    so a reader holds no whole shard in memory on a store either."""
    if file.local:
        return _load_local(file.as_path(), expected_crc32, what, **kwargs)
    with tempfile.TemporaryDirectory(prefix="lightning-zero-read-") as tmp:
        local = Path(tmp) / posixpath.basename(file.path)
        file.fs.get_file(file.path, str(local))
        return _load_local(local, expected_crc32, f"{what}, read from {file}", **kwargs)


def _load_local(file: Path, expected_crc32: int | None, what: str, **kwargs: Any) -> Any:
    verify_file(file, expected_crc32, what)
    options = {"map_location": "cpu", "weights_only": True, "mmap": True, **kwargs}
    try:
        return torch.load(file, **options)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{file} ({what}) holds objects that only full unpickling restores (e.g. hyperparameters saved "
            f"with a pathlib.Path or your own class): {exc}. If you trust this checkpoint, load it with "
            "weights_only=False (Trainer.fit(..., weights_only=False)) or `lightning-zero consolidate "
            "--trust-pickles`."
        ) from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ValueError(
            f"{file} ({what}) cannot be read: {type(exc).__name__}: {exc}. The file is truncated or damaged: "
            "copy the checkpoint again from where it was written, or resume from an earlier one."
        ) from exc


def rank_file_crc32(meta: dict[str, Any], rank: int) -> int | None:
    crcs = meta.get("rank_file_crc32")
    return None if crcs is None else int(crcs[rank])
