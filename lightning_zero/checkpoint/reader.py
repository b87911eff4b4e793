"""Reading a checkpoint by state-dict key, whatever layout wrote it and whatever layout reads it.

:class:`ShardedReader` reads a sharded checkpoint directory (see :mod:`~lightning_zero.checkpoint.format`):
a range of a flattened parameter (or of one of its optimizer states), of the whole parameter or of
one tensor-parallel part of it. When the saved split is the requested one (same partition dim and
tensor-parallel size, or both whole) it opens only the rank files whose pieces overlap the range;
otherwise it assembles the requested part from the saved parts that overlap it, one parameter at a
time. :class:`FullReader` offers the same over a plain state dict of whole tensors.

A node-local checkpoint directory (:mod:`~lightning_zero.checkpoint.io`) holds only its node's rank
files; the reader reads those, takes a whole tensor (frozen parameter, buffer) from the node's copy
(``"copies"`` in its metadata entry), and names the rank, node and path of any other file it would
need. Given the files of every node (``files``, :func:`~lightning_zero.checkpoint.format.union_rank_files`),
it reads their union.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint.io import Location
from lightning_zero.checkpoint.merge import Split


def _narrow(tensor: torch.Tensor, split: Split | None, what: str) -> torch.Tensor:
    """``split``'s part of the whole ``tensor`` (all of it when ``split`` is ``None``)."""
    if split is None:
        return tensor
    return tensor.narrow(split.dim, *split.block(tensor.shape, what))


class ShardedReader:
    """Reads a sharded checkpoint by state-dict key: whole tensors, or ranges of a flattened tensor
    or of one tensor-parallel part of it (any tensor-parallel size, whatever the saved one was)."""

    def __init__(
        self,
        path: fmt.PathLike | Location,
        state_dict: Mapping[str, Any],
        files: dict[int, Location] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.path = path = ckpt_io.location(path)
        self.meta = fmt.read_metadata(path) if meta is None else meta
        # every rank's file (shared storage: ValueError naming the missing ones), or this node's
        self.rank_files = fmt.available_rank_files(path, self.meta) if files is None else files
        self.state_dict = state_dict
        self.params = self.meta["params"]
        self._primary = {key: name for name, e in self.params.items() for key in (name, *e["aliases"])}
        self._files: dict[int, Any] = {}
        self._block: tuple[Any, torch.Tensor | None] = (None, None)  # the last part built by _part

    @classmethod
    def in_memory(
        cls, path: fmt.PathLike | Location, meta: dict[str, Any], state_dict: Mapping[str, Any], rank_data: list[Any]
    ) -> ShardedReader:
        """A reader over every rank's file contents gathered in memory (``rank_data[r]``: what rank
        ``r`` would have written), with the metadata a save writes (``params``, ``state_dict_keys``);
        ``path`` only names the checkpoint in messages."""
        reader = cls(path, state_dict, files=dict.fromkeys(range(len(rank_data))), meta=meta)  # type: ignore[arg-type]
        reader._files = dict(enumerate(rank_data))
        return reader

    def has(self, key: str) -> bool:
        return key in self._primary or key in self.state_dict

    def in_files(self, key: str) -> bool:
        """True when ``key``'s values lie in the rank files (a partitioned parameter, or a frozen
        parameter or buffer saved whole by a data-parallel rank 0), not in Lightning's file."""
        return key in self._primary

    def primary(self, key: str) -> str:
        """:meth:`name_of` ``key`` for a saved parameter, else ``key`` itself."""
        return self._primary.get(key, key)

    def name_of(self, key: str) -> str:
        """The saved parameter that state-dict key ``key`` (a name or a tied alias) refers to."""
        return self._primary[key]

    def keys(self) -> list[str]:
        return list(self._primary) + [k for k in self.state_dict if k not in self._primary]

    def shape(self, key: str) -> torch.Size | None:
        """The whole (unsplit) shape of ``key``."""
        if key in self._primary:
            return torch.Size(self.params[self._primary[key]]["shape"])
        value = self.state_dict[key]
        return value.shape if torch.is_tensor(value) else None

    def rank_data(self, rank: int) -> Any:
        if rank not in self._files:
            if rank not in self.rank_files:
                raise ValueError(
                    f"reading the node-local checkpoint {self.path} needs rank {rank}'s file "
                    f"{self.meta['rank_files'][rank]}, which node {fmt.rank_node(self.meta, rank)} wrote to its own disk "
                    "and which is not here: a node-local checkpoint resumes with the world size and layout that saved "
                    "it, each rank on its node. To load it otherwise, copy every node's files into one directory, or "
                    "consolidate the nodes' directories together (`lightning-zero consolidate DIR0 DIR1 ... OUT`)."
                )
            self._files[rank] = fmt.load_file(
                self.rank_files[rank], fmt.rank_file_crc32(self.meta, rank), f"rank {rank}'s shards"
            )
        return self._files[rank]

    def _holder(self, entry: dict[str, Any], piece: list[int]) -> int:
        """The rank whose file to read ``piece`` from: its own, or a node's copy of it that is here."""
        if piece[0] in self.rank_files:
            return piece[0]
        copies = (c[0] for c in entry.get("copies", ()) if c[1:] == piece[1:] and c[0] in self.rank_files)
        return next(copies, piece[0])

    def _saved(self, name: str) -> Split | None:
        """How ``name`` was split when saved (``Split(dim, 0, T)``), ``None`` when saved whole."""
        entry = self.params[name]
        return (
            None
            if entry["tensor_parallel_size"] == 1
            else Split(entry["partition_dim"], 0, entry["tensor_parallel_size"])
        )

    def holders(self, name: str) -> list[int]:
        """Indices of the optimizers that saved a state of parameter ``name`` (several when the same
        parameter was given to several optimizers; ``"optimizers"`` in the metadata then)."""
        entry = self.params[self._primary.get(name, name)]
        if "optimizers" in entry:
            return list(entry["optimizers"])
        return [] if entry["optimizer"] is None else [entry["optimizer"]]

    def _read_shard(
        self,
        name: str,
        tp_rank: int,
        start: int,
        numel: int,
        state_key: str | None,
        optimizer: int | None = None,
        view: bool = False,
    ) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of saved part ``tp_rank`` of ``name``, flattened
        (of optimizer ``optimizer``'s state ``state_key``: default its first optimizer's). ``view``:
        when one piece holds them all, a view of the memory-mapped file (read-only use, not kept)."""
        entry = self.params[name]
        optimizer = entry["optimizer"] if optimizer is None else optimizer
        out = torch.empty(numel, dtype=fmt.dtype_from_name(entry["saved_dtype"]))  # several pieces: assembled
        for piece in entry["pieces"]:
            _, tp, offset, count = piece
            lo, hi = max(start, offset), min(start + numel, offset + count)
            if tp != tp_rank or lo >= hi:
                continue
            data = self.rank_data(self._holder(entry, piece))
            if state_key is None:
                saved = data["params"][name]
            else:
                saved = data["optim"][optimizer][name]["slices"][state_key]
            if view and (lo, hi) == (start, start + numel):
                # One piece holds the whole range (a resume into the same layout): its elements as they
                # lie in the (memory-mapped) file, not copied here; the caller copies them into place.
                return saved[lo - offset : hi - offset]
            if out.dtype != saved.dtype:
                out = out.to(saved.dtype)
            out[lo - start : hi - start] = saved[lo - offset : hi - offset]
        return out

    def _part(
        self, name: str, split: Split | None, state_key: str | None, optimizer: int | None = None
    ) -> torch.Tensor:
        """The whole tensor ``name`` (``split`` ``None``) or one part of it, assembled from the saved
        parts that overlap it. The last one is kept: a load reads one parameter after another."""
        cache_key = (name, split, state_key, optimizer)
        cached_key, cached = self._block
        if cached_key == cache_key and cached is not None:
            return cached
        full = torch.Size(self.params[name]["shape"])
        saved = self._saved(name)
        if saved is None:
            part = _narrow(self._read_shard(name, 0, 0, full.numel(), state_key, optimizer).view(full), split, name)
        else:
            shard = torch.Size(saved.local_shape(full, name))
            numel = shard.numel()
            start, length = (0, full[saved.dim]) if split is None or split.dim != saved.dim else split.block(full, name)
            pieces = []
            for t in range(saved.size):
                lo, hi = max(start, t * shard[saved.dim]), min(start + length, (t + 1) * shard[saved.dim])
                if lo < hi:
                    whole = self._read_shard(name, t, 0, numel, state_key, optimizer).view(shard)
                    pieces.append(whole.narrow(saved.dim, lo - t * shard[saved.dim], hi - lo))
            part = torch.cat(pieces, dim=saved.dim)
            if split is not None and split.dim != saved.dim:
                part = _narrow(part, split, name)
        part = part.contiguous()
        self._block = (cache_key, part)
        return part

    def read(
        self,
        key: str,
        start: int,
        numel: int,
        state_key: str | None = None,
        split: Split | None = None,
        optimizer: int | None = None,
    ) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor ``key`` (or of optimizer
        ``optimizer``'s state ``state_key``, default its first optimizer's), or of its part ``split``
        under tensor parallelism, as saved (the master dtype). When the saved layout is the requested
        one, opens only the rank files that overlap, and a range within one piece is a view of the
        memory-mapped file: copy it into place, do not keep or modify it."""
        if key not in self._primary:
            return _narrow(self.state_dict[key], split, key).reshape(-1)[start : start + numel]
        name = self._primary[key]
        saved = self._saved(name)
        if saved is None and split is None:
            return self._read_shard(name, 0, start, numel, state_key, optimizer, view=True)
        if saved is not None and split is not None and (saved.dim, saved.size) == (split.dim, split.size):
            return self._read_shard(name, split.rank, start, numel, state_key, optimizer, view=True)
        return self._part(name, split, state_key, optimizer).reshape(-1)[start : start + numel]

    def full(
        self, key: str, split: Split | None = None, state_key: str | None = None, optimizer: int | None = None
    ) -> Any:
        """The whole value of ``key`` (or its part ``split``): a tensor, or a non-tensor entry as saved."""
        if key not in self._primary:
            value = self.state_dict[key]
            return _narrow(value, split, key) if torch.is_tensor(value) else value
        return self._part(self._primary[key], split, state_key, optimizer)

    def optimizer_entry(self, key: str, optimizer: int | None = None) -> dict[str, Any] | None:
        """``{"slices": {state_key: dtype}, "scalars": {...}}`` of parameter ``key`` in optimizer
        ``optimizer``'s state (default: its first optimizer's), or None without state."""
        name = self._primary[key]
        entry = self.params[name]
        holders = self.holders(name)
        optimizer = holders[0] if optimizer is None and holders else optimizer
        if optimizer not in holders or not entry["pieces"]:
            return None
        here = [piece[0] for piece in entry["pieces"] if piece[0] in self.rank_files]
        # Every file holding a piece holds the entry (the same dtypes and scalars): ask one already
        # open. Taking the first piece's file instead made a resume open another rank's whole file for
        # a parameter across the ranks' boundary (on a store a second download, 2.2x a plain get).
        opened = [rank for rank in here if rank in self._files]
        saved = self.rank_data((opened or here or [entry["pieces"][0][0]])[0])["optim"]
        if not saved:
            return None
        state = saved[optimizer].get(name)
        if state is None:
            return None
        return {"slices": {k: v.dtype for k, v in state["slices"].items()}, "scalars": state["scalars"]}


class FullReader:
    """The same interface over a plain state dict of whole tensors (DDP or single-device checkpoints)."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        self.state_dict = state_dict

    def keys(self) -> list[str]:
        return list(self.state_dict)

    def shape(self, key: str) -> torch.Size | None:
        value = self.state_dict[key]
        return value.shape if torch.is_tensor(value) else None

    def read(self, key: str, start: int, numel: int, split: Split | None = None) -> torch.Tensor:
        return _narrow(self.state_dict[key], split, key).reshape(-1)[start : start + numel]

    def full(self, key: str, split: Split | None = None) -> Any:
        value = self.state_dict[key]
        return _narrow(value, split, key) if torch.is_tensor(value) else value
