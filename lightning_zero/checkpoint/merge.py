"""Where a rank sits in the 3D layout, and how every rank's report becomes one ``metadata.json``. Pure.

Each rank describes what it holds in a *report* (built by :func:`~lightning_zero.checkpoint.pieces.rank_report`)::

    {"rank": global rank, "pp_rank": pipeline stage,
     "state_dict_keys": [this rank's module state-dict keys],
     "params": {local name: {"names": [name, *tied names], "shape": full (unsplit) shape,
                             "dtype": .., "saved_dtype": .., "optimizer": index or None,
                             "partition_dim": d or None, "tensor_parallel_size": T (1 when whole),
                             "piece": [rank, tp_rank, offset, numel] or None}},
     "optimizer_names": [[[names of group g] per group] or None per optimizer],
     "copies": {key: piece} (node-local storage only: the whole tensors a data-parallel rank other
               than 0 could write again for its node, see :func:`keep_copies`)}

``piece`` is the rank's contiguous piece of the flattened *shard* it holds (its tensor-parallel
part, or the whole tensor when not split). Reports are gathered on every rank and merged the
same way everywhere (:func:`merge_reports`): entries that share a name (a tied weight seen under
another name on another pipeline stage) become one, named by the first rank that reported it; of
a tied weight that several pipeline stages hold, the pieces of the first such stage are kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_zero.layout import Coordinates, ParallelLayout


@dataclass(frozen=True)
class Split:
    """Part ``rank`` of ``size`` equal contiguous parts of a tensor along ``dim`` (Megatron's split)."""

    dim: int
    rank: int
    size: int

    def block(self, full_shape: Iterable[int], what: str = "tensor") -> tuple[int, int]:
        """``(start, length)`` of this part along ``dim`` of a tensor of ``full_shape``.

        Raises:
            ValueError: when ``full_shape[dim]`` is not divisible by ``size``.
        """
        shape = list(full_shape)
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"{what}: partition dim {self.dim} is outside its shape {tuple(shape)}")
        if shape[self.dim] % self.size:
            raise ValueError(
                f"{what} has full shape {tuple(shape)}; dim {self.dim} of size {shape[self.dim]} is not divisible "
                f"by the tensor-parallel size {self.size}. Load it with a tensor_parallel_size that divides "
                f"{shape[self.dim]}."
            )
        length = shape[self.dim] // self.size
        return self.rank * length, length

    def local_shape(self, full_shape: Iterable[int], what: str = "tensor") -> list[int]:
        """The shape of this part."""
        shape = list(full_shape)
        shape[self.dim] = self.block(shape, what)[1]
        return shape


@dataclass(frozen=True)
class Placement:
    """One global rank in a :class:`~lightning_zero.layout.ParallelLayout` (tensor rank fastest)."""

    rank: int
    layout: ParallelLayout

    @classmethod
    def of(cls, rank: int, world_size: int, layout: ParallelLayout | None) -> Placement:
        """``layout`` (``None``: all ranks data-parallel), checked against ``world_size``."""
        layout = layout if layout is not None else ParallelLayout(world_size)
        layout.check_world(world_size)
        return cls(rank, layout)

    @property
    def coords(self) -> Coordinates:
        return self.layout.coordinates(self.rank)

    def split(self, partition_dim: int | None) -> Split | None:
        """This rank's part of a parameter split along ``partition_dim`` (``None``: a whole one)."""
        if partition_dim is None or self.layout.tensor == 1:
            return None
        return Split(partition_dim, self.coords.tp, self.layout.tensor)

    def full_shape(self, local_shape: Iterable[int], partition_dim: int | None) -> list[int]:
        """The unsplit shape of a parameter whose part here has ``local_shape``."""
        shape = list(local_shape)
        if partition_dim is not None and self.split(partition_dim) is not None:
            shape[partition_dim] *= self.layout.tensor
        return shape


def ordered_union(lists: Iterable[Iterable[str]]) -> list[str]:
    """Every item of ``lists``, once, in order of first appearance."""
    return list(dict.fromkeys(item for items in lists for item in items))


_SAME = ("shape", "partition_dim", "tensor_parallel_size")


def _conflict(name: str, kept: dict[str, Any], new: dict[str, Any], rank: int) -> str | None:
    for field in _SAME:
        if kept[field] != new[field]:
            return f"{name}: {field} {kept[field]} on an earlier rank but {new[field]} on rank {rank}"
    return None


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"params": {name: entry}, "state_dict_keys": [...], "optimizer_names": [...], "alias_of": {name: primary}}``.

    ``entry`` is the report's entry without ``names``/``piece``, with ``aliases`` (the other names of
    the same tensor) and ``pieces`` (``[rank, tp_rank, offset, numel]``, sorted).

    Raises:
        ValueError: naming the parameter and ranks when reports disagree on a shape or split, when
            the pieces of a shard do not cover it exactly once, or when optimizers differ across ranks.
    """
    params: dict[str, dict[str, Any]] = {}
    alias_of: dict[str, str] = {}
    stage_of: dict[tuple[str, int], int] = {}  # (primary, tp_rank) -> the pipeline stage whose pieces are kept
    for report in sorted(reports, key=lambda r: r["rank"]):
        for entry in report["params"].values():
            names = entry["names"]
            primary = next((alias_of[n] for n in names if n in alias_of), names[0])
            if primary not in params:
                params[primary] = {k: v for k, v in entry.items() if k not in ("names", "piece")}
                params[primary].update(aliases=[], pieces=[])
            kept = params[primary]
            problem = _conflict(primary, kept, entry, report["rank"])
            if problem:
                raise ValueError(
                    f"the ranks disagree about a parameter: {problem}; every rank must build the same model."
                )
            for name in names:
                alias_of.setdefault(name, primary)
                if name != primary and name not in kept["aliases"]:
                    kept["aliases"].append(name)
            piece = entry["piece"]
            if piece is not None and stage_of.setdefault((primary, piece[1]), report["pp_rank"]) == report["pp_rank"]:
                kept["pieces"].append(list(piece))
    for report in reports:  # node-local storage: whole tensors other data-parallel ranks offer to write too
        for key, piece in report.get("copies", {}).items():
            primary = alias_of.get(key)
            if primary is not None and stage_of.get((primary, piece[1])) == report["pp_rank"]:
                params[primary].setdefault("copies", []).append(list(piece))
    for name, entry in params.items():
        entry["pieces"].sort()
        check_coverage(name, entry)
    return {
        "params": params,
        "alias_of": alias_of,
        "state_dict_keys": ordered_union(r["state_dict_keys"] for r in sorted(reports, key=lambda r: r["rank"])),
        "optimizer_names": merge_optimizer_names(reports, alias_of),
    }


def shard_numel(entry: dict[str, Any]) -> int:
    """Elements of one tensor-parallel shard of ``entry`` (the whole tensor when not split)."""
    numel = 1
    for size in entry["shape"]:
        numel *= size
    return numel // entry["tensor_parallel_size"]


def check_coverage(name: str, entry: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the pieces of each shard tile ``[0, shard_numel)`` exactly once."""
    numel = shard_numel(entry)
    for tp_rank in range(entry["tensor_parallel_size"]):
        spans = sorted((offset, count) for _, t, offset, count in entry["pieces"] if t == tp_rank)
        end = 0
        for offset, count in spans:
            end = end + count if offset == end else -1
        if end != numel:
            raise ValueError(
                f"the saved pieces of {name} (tensor-parallel part {tp_rank}) cover {spans} of its {numel} "
                "elements, not each exactly once; the ranks hold different models."
            )


def merge_optimizer_names(reports: list[dict[str, Any]], alias_of: dict[str, str]) -> list[list[list[str]] | None]:
    """Per optimizer, per parameter group: the primary names of its parameters over all ranks (the
    stages of a pipeline each hold some), each once."""
    per_rank = [r["optimizer_names"] for r in sorted(reports, key=lambda r: r["rank"])]
    counts = {len(names) for names in per_rank}
    if len(counts) > 1:
        raise ValueError(f"the ranks have different numbers of optimizers: {[len(n) for n in per_rank]}")
    merged: list[list[list[str]] | None] = []
    for index in range(counts.pop() if counts else 0):
        groups = [names[index] for names in per_rank if names[index] is not None]
        if not groups:
            merged.append(None)
            continue
        sizes = {len(g) for g in groups}
        if len(sizes) > 1:
            raise ValueError(
                f"optimizer {index} has different numbers of parameter groups across ranks: {sorted(sizes)}"
            )
        merged.append([ordered_union([alias_of.get(n, n) for n in g[i]] for g in groups) for i in range(sizes.pop())])
    return merged


def keep_copies(merged: dict[str, Any], rank_nodes: list[int]) -> None:
    """Node-local storage: of the ``copies`` of each whole tensor (frozen parameter, buffer) that
    :func:`merge_reports` collected, keep one per node and tensor-parallel part, from the node's first
    rank that holds it, and none on a node whose ranks already write the piece itself; so every
    node's directory has each such tensor once. In place."""
    for entry in merged["params"].values():
        offered = entry.pop("copies", None)
        if not offered:
            continue
        covered = {(rank_nodes[rank], tp) for rank, tp, _, _ in entry["pieces"]}
        kept = []
        for piece in sorted(offered):
            where = (rank_nodes[piece[0]], piece[1])
            if where not in covered:
                covered.add(where)
                kept.append(piece)
        if kept:
            entry["copies"] = kept
