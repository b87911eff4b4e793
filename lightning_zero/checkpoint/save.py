"""Writing a sharded checkpoint: every rank its own file, in parallel; atomic on all ranks together.

A save into ``PATH`` goes through three agreements (an ``all_gather_object`` of "ok / what failed",
so a failure on one rank raises on every rank instead of leaving the others waiting)::

    rank 0     empties the hidden temporary directory .zero-tmp-HASH (left by a killed save) and creates it
    all ranks  write rank-RRRRR.pt (rank 0 also lightning.pt) there and fsync them
    rank 0     writes metadata.json last (the completeness marker) and renames the directory into place;
               an existing PATH is first renamed aside to .zero-old-HASH, then deleted

The steps are those of a :class:`ShardedSave`: ``prepare`` (the first agreement), ``write``,
``commit`` (the second) and ``publish`` (the third); :func:`save_sharded` runs them in one call.
The last two, and the :class:`~lightning_zero.checkpoint.commit.PendingSave` an asynchronous save
returns, are in :mod:`~lightning_zero.checkpoint.commit`; the agreements in
:mod:`~lightning_zero.checkpoint.agreement`; the file operations (checksummed, flushed writes; the
renames) in :mod:`~lightning_zero.checkpoint.files`.

So a kill at any moment leaves either the previous checkpoint at PATH (or, between the two renames,
at .zero-old-HASH, which :func:`~lightning_zero.checkpoint.format.resolve` finds), or the new one;
a directory without ``metadata.json`` is never loaded. A save that fails on any rank removes its
temporary directory. Every rank writes under the path rank 0 resolved, on a filesystem all ranks
share; a rank that cannot see it is named in a ``ValueError`` before any file is written
(:mod:`~lightning_zero.checkpoint.io`).

On any other fsspec filesystem (``s3://``, ``gs://``, ``az://``: no rename) the same three agreements
publish by writing ``metadata.json`` last into ``PATH`` itself, the rank files under a prefix new for
each save (:mod:`~lightning_zero.checkpoint.store`); each rank streams its file through the
filesystem's writer, so no more than one write buffer of it is in memory.

Under node-local storage (``node`` given, :mod:`~lightning_zero.checkpoint.io`) each node's writer
(its local rank 0) does rank 0's part for its node's ranks, in the directory as it resolves the path:
the temporary directory (one name per node), ``lightning.pt`` (rank 0's bytes, gathered to it in the
agreement that follows the snapshot), the whole tensors of its node (:func:`~lightning_zero.checkpoint.merge.keep_copies`),
``metadata.json`` (the same on every node, with ``rank_nodes``) and the rename.

Speed: a synchronous save pickles straight from the engine's host tensors (no copy of the
shard), checksums with the compiled CRC-32 (:mod:`lightning_zero.ops.checksum`) and starts the disk
writes along the way (:class:`~lightning_zero.checkpoint.files.Flusher`). An asynchronous save's training-thread work is the copy
into the run's :class:`~lightning_zero.checkpoint.host_buffer.HostBuffer` (allocated ahead, after the
first optimizer step) and three small agreements; the pickling, checksum, writes and fsync run in
the writer thread; the publication (``metadata.json``, rename) runs at the next step boundary that
finds every writer done.

Nothing is gathered: rank r's file holds only the pieces in r's slices (see
:mod:`~lightning_zero.checkpoint.format`), and the optimizer states Lightning asks for through
``strategy.optimizer_state`` are only the parameter groups' hyperparameters
(:func:`~lightning_zero.checkpoint.lightning_dict.optimizer_groups`, with the rest of what Lightning's
own dict holds in :mod:`~lightning_zero.checkpoint.lightning_dict`).
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning
import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.checkpoint import files, rng, store
from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint.agreement import agree, guarded
from lightning_zero.checkpoint.commit import PendingSave, commit_save, discard, poll_save
from lightning_zero.checkpoint.host_buffer import HostBuffer
from lightning_zero.checkpoint.io import Location
from lightning_zero.checkpoint.lightning_dict import (
    SHARDED_OPTIMIZER_MARKER,
    lightning_state,
    loader_state,
    optimizer_groups,
)
from lightning_zero.checkpoint.merge import Placement, keep_copies, merge_reports
from lightning_zero.checkpoint.pieces import (
    local_shards,
    overrides,
    partitioned_params,
    rank_payload,
    rank_report,
)
from lightning_zero.layout import ParallelLayout
from lightning_zero.ops import checksum

if TYPE_CHECKING:
    from lightning_zero.zero import ZeroEngine

__all__ = [
    "SHARDED_OPTIMIZER_MARKER",
    "HostBuffer",
    "PendingSave",
    "SaveSource",
    "ShardedSave",
    "commit_save",
    "loader_state",
    "optimizer_groups",
    "poll_save",
    "remove_sharded",
    "reserve_host_buffer",
    "save_sharded",
]


def _write(obj: Any, file: Location) -> tuple[int, int]:
    """``torch.save``, streamed: locally with fsync (the rename that publishes the checkpoint must not
    overtake the data; disk writes started along the way by a :class:`~lightning_zero.checkpoint.files.Flusher`), on a store through
    fsspec's writer (one buffer in memory, uploaded part by part; the object exists once closed).
    Returns the file's size and the CRC-32 of its bytes, computed while writing."""
    if not file.local:
        with file.open("wb") as f:
            out = files.Checksummed(f)
            torch.save(obj, out)  # type: ignore[arg-type]  # a write()/flush() object is all torch.save uses
        return out.size, out.crc32
    with open(file.as_path(), "wb") as f:
        flusher = files.Flusher(f.fileno())
        try:
            out = files.Checksummed(f, flusher)
            torch.save(obj, out)  # type: ignore[arg-type]  # as above
        finally:
            flusher.close()
        f.flush()
        os.fsync(f.fileno())
    return file.as_path().stat().st_size, out.crc32


def _write_files(
    tmp: Location, rank: int, payload: dict[str, Any], lightning_bytes: bytes | None
) -> tuple[int, int, int | None]:
    """Write this rank's file (rank 0 also ``lightning.pt``) into ``tmp``; the rank file's size and
    CRC-32, and ``lightning.pt``'s CRC-32 (rank 0)."""
    size, crc = _write(payload, tmp / fmt.rank_file(rank))
    lightning_crc = None
    if lightning_bytes is not None:
        file = tmp / fmt.LIGHTNING_FILE
        with file.open("wb") as f:
            f.write(lightning_bytes)
            if file.local:
                f.flush()
                os.fsync(f.fileno())
        lightning_crc = checksum.crc32(lightning_bytes)
    return size, crc, lightning_crc


@dataclass(frozen=True)
class SaveSource:
    """What a save writes: Lightning's dict and the state the engine holds for ``module``."""

    checkpoint: dict[str, Any]
    """Lightning's checkpoint dict; its ``state_dict`` holds only the tensors ZeRO does not partition."""
    module: nn.Module
    engine: ZeroEngine | None
    optimizers: list[torch.optim.Optimizer]
    precision: str


class ShardedSave:
    """One save of a sharded checkpoint, as a transaction of four steps (see the module docstring)::

        prepare()   agreement: the writer makes the temporary directory (or begins the store's
                    save), every rank reports its pieces; then every rank checks it sees the directory
        write()     this rank's file (rank 0 also lightning.pt) into the temporary directory, now or
                    in a thread (asynchronous save); returns the PendingSave
        commit()    agreement on every rank's write; a failure anywhere removes the temporary files
        publish()   the writer writes metadata.json last and renames the directory into place

    :func:`commit_save` runs the last two. A failure at any step raises on every rank (each
    agreement exchanges every rank's outcome, so none waits for a rank that failed), leaves the
    previous checkpoint at the path as it was, and removes what this save wrote.

    Args:
        source: what to save.
        filepath: the checkpoint directory (a local path or an fsspec URL); the same on every rank.
        layout: the run's data x tensor x pipeline layout (``None``: data parallel only).
        node: node-local storage: this rank's node and local rank.
        deletions: where a thread deleting the replaced checkpoint goes (``None``: deleted at once).
    """

    def __init__(
        self,
        source: SaveSource,
        filepath: fmt.PathLike,
        *,
        layout: ParallelLayout | None = None,
        node: ckpt_io.NodeRanks | None = None,
        deletions: list[threading.Thread] | None = None,
    ) -> None:
        self.source = source
        self.group = None  # the whole world: under tensor/pipeline parallelism the engine's group is a part of it
        self.placement = Placement.of(comm.rank(self.group), comm.world_size(self.group), layout)
        self.rank, self.world_size = self.placement.rank, self.placement.layout.world_size
        self.mine = ckpt_io.location(filepath)  # an unknown protocol raises on every rank alike, before any work
        if node is not None and not self.mine.local:
            raise ValueError(
                f"node_local_storage=True writes each node's files to its own disk, but {self.mine} is not a local "
                "path: an object store is shared by every node. Use node_local_storage=False for object-store "
                "checkpoints."
            )
        self.node = node
        self.deletions = deletions
        self.save_id = uuid.uuid4().hex[:12] if self.rank == 0 else None
        self.writes = self.rank == 0 if node is None else node.writer
        self.has_optimizer_states = "optimizer_states" in source.checkpoint
        self.mid_window = False  # set by the snapshot: the same on every rank (windows end together)
        # set by prepare(): where the files go, and what every rank holds
        self.path = self.tmp = self.mine
        self.marker: Location | None = None
        self.merged: dict[str, Any] = {}
        self.nodes: list[int] | None = None
        self.rank_files: list[str] = []

    @staticmethod
    def _temporary(where: Location, node_rank: int | None) -> Location:
        return fmt.temporary_path(where) if node_rank is None else fmt.node_temporary_path(where, node_rank)

    def prepare(self) -> None:
        """The first agreement and the visibility check (see the class docstring). Call on all ranks."""
        mine, node, src = self.mine, self.node, self.source

        def start() -> tuple[str | None, str | None, ckpt_io.NodeRanks | None, dict[str, Any]]:
            if self.writes:
                if mine.local:
                    tmp = self._temporary(mine, None if node is None else node.node).as_path()
                    files.clear(tmp)
                    tmp.mkdir(parents=True)
                else:
                    store.begin(mine, self.save_id or "")
            report = rank_report(src.module, src.engine, src.optimizers, self.placement, copies=node is not None)
            return (mine.path if self.writes else None), self.save_id, node, report

        prepared = agree(guarded(start), self.group, f"starting the save of {mine}")
        everyone = None if node is None else [where for _, _, where, _ in prepared]
        nodes = self.nodes = None if everyone is None else [r.node for r in everyone]
        writer_of = {0: 0} if everyone is None else ckpt_io.writers([w for w in everyone if w is not None])
        # The writer's resolution: one directory whatever each rank's working directory (one per node
        # under node-local storage)
        my_node = 0 if node is None else node.node
        path = self.path = ckpt_io.same_place(mine, str(prepared[writer_of[my_node]][0]))
        self.save_id = prepared[0][1] or ""
        marker = self.marker = None if path.local else fmt.temporary_path(path)
        tmp = self.tmp = (
            self._temporary(path, None if node is None else my_node)
            if path.local
            else store.files_dir(path, self.save_id)
        )
        self.merged = merge_reports([report for _, _, _, report in prepared])
        if nodes is not None:
            keep_copies(self.merged, nodes)
        self.rank_files = [
            fmt.rank_file(r) if path.local else f"{tmp.name}/{fmt.rank_file(r)}" for r in range(self.world_size)
        ]

        seen = marker if marker is not None else tmp
        if not path.local:
            path.refresh()
        # Under node-local storage a writer that resolved the same path as another node's writer and sees
        # that node's temporary directory shares its storage with it: their files would collide.
        crossed = self.writes and any(
            prepared[w][0] == path.path and self._temporary(path, n).exists()
            for n, w in writer_of.items()
            if n != my_node
        )
        flags = comm.all_gather_object((seen.exists(), crossed), self.group)
        blind = [r for r, (ok, _) in enumerate(flags) if not ok]
        sharing = sorted({nodes[r] for r, (_, shared) in enumerate(flags) if shared}) if nodes is not None else []
        if blind or sharing:
            discard(self.writes, tmp, marker)
            if sharing:
                raise ckpt_io.shared_storage_error(path, sharing)
            raise ckpt_io.not_visible_error(path, seen, blind, self.world_size)

    def snapshot(self) -> tuple[dict[str, Any], bytes | None]:
        """This rank's file's contents (views of the engine's host tensors) and, on rank 0, the bytes of
        ``lightning.pt``. Local."""
        src = self.source
        replaced = overrides(
            src.checkpoint["state_dict"], src.module, src.engine
        )  # an EMA's weights, put there by its callback
        values, optim = rank_payload(src.module, src.engine, src.optimizers, self.merged, self.rank, replaced)
        payload: dict[str, Any] = {
            "params": values,
            "optim": optim if self.has_optimizer_states else [],
            "rng": rng.collect(),
        }
        # Resuming exactly mid-epoch: this rank's data loader state (Lightning's dict keeps rank 0's) and,
        # in the middle of an accumulation window, the gradients accumulated since the last step.
        payload["loader"] = loader_state(src.checkpoint)
        window = src.engine.window_state() if src.engine is not None and self.has_optimizer_states else None
        payload["window"] = window
        self.mid_window = window is not None
        lightning_bytes = None
        if self.rank == 0:
            buffer = io.BytesIO()  # small (no partitioned tensors): serialized now, as Lightning's dict may change
            torch.save(lightning_state(src.checkpoint, self.merged), buffer)
            lightning_bytes = buffer.getvalue()
        return payload, lightning_bytes

    def write(self, background: bool = False, host_buffer: HostBuffer | None = None) -> PendingSave:
        """Write this rank's files into the temporary directory. Synchronous: written when this returns,
        the outcome (or the failure) kept in the :class:`PendingSave` for :meth:`commit`. ``background``:
        the pieces are copied into ``host_buffer`` (a buffer of this save's own by default) in one
        agreement, and a thread writes them. Call on all ranks, after :meth:`prepare`."""
        tmp, rank, node = self.tmp, self.rank, self.node
        pending = PendingSave(
            path=self.path,
            tmp=tmp,
            marker=self.marker,
            rank=rank,
            writes=self.writes,
            group=self.group,
            meta=self.metadata,
            deletions=self.deletions,
        )
        if not background and node is None:
            pending.outcome = guarded(lambda: _write_files(tmp, rank, *self.snapshot()))
            return pending
        taken: list[tuple[dict[str, Any], bytes | None]] = []
        buffer = host_buffer if host_buffer is not None else HostBuffer()

        def take() -> bytes | None:
            payload, own = self.snapshot()
            taken.append((buffer.copy(payload) if background else payload, own))
            return own if node is not None else None  # rank 0's bytes, for the other nodes' writers

        try:
            sent = agree(guarded(take), self.group, f"copying the shards of {self.path} to host")
        except RuntimeError:
            discard(self.writes, tmp, self.marker)
            raise
        payload, own = taken.pop()
        lightning_bytes = own if node is None else (sent[0] if self.writes else None)
        if not background:
            pending.outcome = guarded(lambda: _write_files(tmp, rank, payload, lightning_bytes))
            return pending
        pending.start(lambda: _write_files(tmp, rank, payload, lightning_bytes))
        buffer.user = pending
        return pending

    def metadata(self, written: list[tuple[int, int, int | None]]) -> dict[str, Any]:
        """``metadata.json``'s contents, given every rank's ``(file size, CRC-32, lightning.pt's CRC-32)``."""
        layout, engine, path, tmp = self.placement.layout, self.source.engine, self.path, self.tmp
        return {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "stage": engine.config.zero.stage if engine is not None else None,
            "world_size": self.world_size,
            "layout": {"data": layout.data, "tensor": layout.tensor, "pipeline": layout.pipeline},
            "precision": self.source.precision,
            "has_optimizer_states": self.has_optimizer_states,
            "mid_window": self.mid_window,  # the same on every rank: windows end together
            "rank_files": self.rank_files,
            "rank_file_bytes": [size for size, _, _ in written],
            # CRC-32 of every file, checked by each reader before it trusts a file's bytes
            "rank_file_crc32": [crc for _, crc, _ in written],
            "lightning_file_crc32": next((crc for _, _, crc in written if crc is not None), None),
            "save_id": self.save_id,  # the same in every node's copy (node-local storage): their union is one save
            **({} if self.nodes is None else {"rank_nodes": self.nodes}),
            **({} if path.local else {"lightning_file": f"{tmp.name}/{fmt.LIGHTNING_FILE}"}),
            "state_dict_keys": self.merged["state_dict_keys"],
            "params": self.merged["params"],
            "torch_version": torch.__version__,
            "lightning_version": lightning.__version__,
        }


def save_sharded(
    checkpoint: dict[str, Any],
    filepath: fmt.PathLike,
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    precision: str,
    layout: ParallelLayout | None = None,
    background: bool = False,
    node: ckpt_io.NodeRanks | None = None,
    host_buffer: HostBuffer | None = None,
    deletions: list[threading.Thread] | None = None,
) -> PendingSave | None:
    """Write ``checkpoint`` (Lightning's dict) and the engine's shards to the directory ``filepath``:
    a :class:`ShardedSave` run through its four steps (the strategies' one call).

    ``checkpoint["state_dict"]`` should hold only the tensors ZeRO does not partition (what the
    strategy's ``lightning_module_state_dict`` returns); its tensors are written into the rank files
    (data-parallel rank 0 of each tensor/pipeline position), the rest into ``lightning.pt``.
    ``layout`` is the run's data x tensor x pipeline layout (``None``: data parallel only). Call on
    all ranks of the default process group, with the same ``filepath``.

    ``background=True`` (asynchronous save): this rank's pieces are copied into host memory and a
    thread writes them; the call returns a :class:`PendingSave` at once, which :func:`poll_save` or
    :func:`commit_save` (all ranks, main thread) publishes once every rank's thread has finished.
    Until then the previous checkpoint at ``filepath`` stays as it was.

    ``host_buffer``: where a background save copies this rank's pieces (kept by the caller and reused
    by its next save; default a buffer of this save's own).

    ``deletions``: the replaced checkpoint (same path) is deleted by a thread appended there, for the
    caller to join (default: deleted before the save returns).

    ``node`` (node-local storage): this rank's node and local rank; each node writes its own ranks'
    files under ``filepath`` as its local rank 0 resolves it (a local path only).
    """
    source = SaveSource(checkpoint, module, engine, optimizers, precision)
    save = ShardedSave(source, filepath, layout=layout, node=node, deletions=deletions)
    save.prepare()
    pending = save.write(background, host_buffer)
    if background:
        return pending
    commit_save(pending)
    return None


def reserve_host_buffer(
    buffer: HostBuffer, module: nn.Module, engine: ZeroEngine, optimizers: list[torch.optim.Optimizer]
) -> None:
    """Have ``buffer`` allocate, in a background thread, the host memory an async save of this rank's
    shards will copy into (the masters and optimizer states as they are now: call after the first
    optimizer step has created the states), so that the first save's stall is the copy alone and
    not also the page faults of a fresh allocation. Local."""
    values, optim = local_shards(partitioned_params(module, engine), engine, optimizers, views=True)
    buffer.reserve({"params": values, "optim": optim})


def remove_sharded(filepath: fmt.PathLike) -> None:
    """Delete a checkpoint (directory, link or plain file). Call on one rank.

    A directory is renamed to a hidden name before it is deleted, so a kill during the deletion never
    leaves a partial directory under a checkpoint's name. A directory that is not a lightning_zero
    checkpoint is refused.
    """
    where = ckpt_io.location(filepath)
    if not where.local:
        where.refresh()
        if where.is_file():
            where.fs.rm(where.path)
        elif where.exists():
            if not fmt.is_sharded_checkpoint(where):
                raise ValueError(f"refusing to delete {where}: it is not a lightning_zero sharded checkpoint.")
            store.remove(where)
        return
    path = where.as_path()
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    if not fmt.is_sharded_checkpoint(path):
        raise ValueError(f"refusing to delete {path}: it is a directory but not a lightning_zero sharded checkpoint.")
    trash = fmt.trash_path(path)
    files.clear(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)
