"""Where a checkpoint goes: one path for all ranks, any fsspec URL, and the check that every rank can see it.

Every rank of a save writes under the directory **rank 0** resolved (``~`` expanded, a relative path
taken from rank 0's working directory), as Lightning does under DDP: ranks started from different
working directories (one per node) still write one checkpoint. The resolved path travels in the
save's first agreement (:mod:`~lightning_zero.checkpoint.save`), so this costs no extra collective.

A path may be any URL that fsspec (a Lightning dependency) resolves, the same that Lightning takes
for ``default_root_dir``, ``ModelCheckpoint(dirpath=...)`` and ``ckpt_path``: ``file://`` (the local
filesystem), ``s3://`` (with ``s3fs`` installed), ``gs://`` (``gcsfs``), ``az://`` (``adlfs``),
``memory://`` (one process only) ... A :class:`Location` is such a path: the fsspec filesystem and
the path inside it. Credentials and endpoints come from the filesystem package's own configuration
(environment variables such as ``AWS_ENDPOINT_URL``, ``~/.aws``, fsspec's ``FSSPEC_S3_*``), as for
Lightning's own checkpoints. Nothing of the storage is ours but the commit protocol: a local (or
shared, NFS/Lustre) filesystem publishes a save by renaming a hidden directory; any other filesystem
(an object store has no rename) by writing ``metadata.json`` last (:mod:`~lightning_zero.checkpoint.store`).

Ranks must all see the checkpoint's storage. At setup, before the first step, rank 0 writes a marker
file into every ``ModelCheckpoint`` directory and the other ranks look for it (:func:`check_shared`);
a rank that does not see it gets a ``ValueError`` naming the ranks, the directory and the ways out.
Paths given only at save time (``trainer.save_checkpoint``) are checked at that save: a rank that
cannot see what rank 0 created for it (the temporary directory, or on a store the pending marker) is
found before any rank writes its file (:func:`not_visible_error`).

**Node-local storage** (``node_local_storage=True``, DeepSpeed's ``use_node_local_storage``): for
clusters without a shared filesystem, each node keeps its own ranks' files on its own disk. Every
node's first process (local rank 0, its *writer*) resolves the path itself (``/local_ssd/ck`` on
every node, each its own disk) and plays rank 0's part for its node: it creates the temporary
directory, writes ``lightning.pt`` (rank 0's bytes, sent to it), ``metadata.json`` (the same on every
node) and one copy of the tensors ZeRO does not partition (frozen parameters, buffers), and renames
the directory into place. So each node's directory holds everything its ranks need to resume with
the same world size and layout; each rank checks its own file (presence and CRC-32) at resume, and
a missing one raises a ``ValueError`` naming the rank, its node and the path on every rank.
``lightning-zero consolidate DIR_NODE0 DIR_NODE1 ... OUT`` reads the union of the nodes' directories
(every rank's file exactly once). The setup check then runs per node, and also fails when two nodes
see each other's markers (the storage is shared: use the default instead). Object stores (``s3://``)
are shared by nature and take no node-local option.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike


@dataclass(frozen=True)
class Location:
    """A path on an fsspec filesystem: ``fs`` (e.g. ``LocalFileSystem``, ``S3FileSystem``) and ``path``
    inside it (no protocol; absolute for the local filesystem)."""

    fs: Any
    path: str

    @property
    def local(self) -> bool:
        """Whether this is the local filesystem (atomic rename, fsync, memory-mapped reads)."""
        from fsspec.implementations.local import LocalFileSystem

        return isinstance(self.fs, LocalFileSystem)

    def __truediv__(self, name: str) -> Location:
        return Location(self.fs, posixpath.join(self.path, name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path))

    def __str__(self) -> str:
        """A local path as it is, anything else as a URL (``s3://bucket/key``)."""
        return self.path if self.local else str(self.fs.unstrip_protocol(self.path))

    def __fspath__(self) -> str:
        """The local path (``open(location)`` works for local locations only)."""
        if not self.local:
            raise TypeError(f"{self} is not on the local filesystem; open it with its .open()")
        return self.path

    def as_path(self) -> Path:
        """The local path (only for :attr:`local` locations)."""
        assert self.local, self
        return Path(self.path)

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def size(self) -> int:
        return int(self.fs.size(self.path))

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.path, mode)

    def refresh(self) -> None:
        """Forget the filesystem's cached listings (another rank or process may have written since)."""
        self.fs.invalidate_cache()


def location(filepath: PathLike | Location) -> Location:
    """``filepath`` as a :class:`Location`, resolved on the calling rank: a local path absolute and
    user-expanded, a URL through fsspec (raising ``ImportError`` naming the package when its filesystem
    is not installed, as Lightning does)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(filepath, Location):
        return filepath
    text = os.fspath(filepath)
    if "://" not in text and "::" not in text:
        return Location(LocalFileSystem(), str(Path(text).expanduser().absolute()))
    fs, inner = url_to_fs(text)
    if isinstance(fs, LocalFileSystem):
        return Location(fs, str(Path(inner).expanduser().absolute()))
    return Location(fs, inner.rstrip("/"))


def same_place(mine: Location, rank0_path: str) -> Location:
    """Rank 0's resolution of the path on this rank's filesystem object (every rank was given the same URL)."""
    return Location(mine.fs, rank0_path)


@dataclass(frozen=True)
class NodeRanks:
    """Where a rank runs, for node-local checkpoints: its node (Lightning's ``node_rank``) and its rank
    on that node (``local_rank``); local rank 0 is the node's writer."""

    node: int
    local_rank: int

    @property
    def writer(self) -> bool:
        return self.local_rank == 0


WAYS_OUT = (
    "Two ways out: put checkpoints (Trainer(default_root_dir=...), ModelCheckpoint(dirpath=...), "
    "trainer.save_checkpoint(...)) on a filesystem all nodes mount at the same path (NFS, Lustre, GPFS) or on an "
    "object store every node reaches (s3://, gs://, az://); or keep each node's ranks' files on that node's own "
    "disk with ZeroStrategy(node_local_storage=True) (see docs/checkpoints.md)."
)


def writers(nodes: list[NodeRanks]) -> dict[int, int]:
    """``{node: global rank of its writer}`` from every rank's :class:`NodeRanks` (in rank order);
    ``ValueError`` unless each node has exactly one local rank 0."""
    found: dict[int, list[int]] = {}
    for rank, where in enumerate(nodes):
        found.setdefault(where.node, [])
        if where.writer:
            found[where.node].append(rank)
    bad = {node: ranks for node, ranks in found.items() if len(ranks) != 1}
    if bad:
        raise ValueError(
            f"node-local checkpoints need exactly one local rank 0 per node, but the cluster environment reports "
            f"{bad} (node: its ranks with local_rank 0); check the launcher's node and local ranks."
        )
    return {node: ranks[0] for node, ranks in found.items()}


def not_visible_error(path: Location, seen: Location, ranks: list[int], world_size: int) -> ValueError:
    """The error for ranks that do not see ``seen``, which their writer (rank 0, or under node-local
    storage their node's local rank 0) created for the save into ``path``."""
    return ValueError(
        f"ranks {ranks} (of {world_size}) cannot see {seen} that rank 0 (or their node's writer) created for the "
        f"checkpoint {path}: the ranks do not share the storage that holds it (a node-local disk, a directory that "
        "exists on one node only, or a memory:// filesystem, which lives in one process). Every rank writes its own "
        f"file into the checkpoint. {WAYS_OUT}"
    )


def shared_storage_error(path: Location, nodes: list[int]) -> ValueError:
    """Under node-local storage: nodes that see another node's files in ``path`` share the storage."""
    return ValueError(
        f"node_local_storage=True, but nodes {nodes} see each other's files under {path}: their storage is shared, "
        "so their writers would overwrite each other's checkpoint. Use node_local_storage=False (the default: every "
        "rank writes under rank 0's directory), or a path on each node's own disk."
    )


def _deepest_existing(where: Location) -> Location:
    """``where``, or locally its nearest existing parent (the check creates no directory); a store's
    prefixes need not exist before an object is written under them."""
    if not where.local:
        return where
    path = where.as_path()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return Location(where.fs, str(path))


def check_shared(directories: list[PathLike], group: Any, node: NodeRanks | None = None) -> None:
    """Before training: rank 0 (under node-local storage, ``node`` given: each node's writer) writes a
    marker file into each checkpoint directory, every rank looks for its writer's, and ranks that do
    not see it get a ``ValueError`` naming them, the directory and the ways out (on every rank alike,
    so none waits); under node-local storage a writer that sees another node's marker means shared
    storage (also a ``ValueError``). Small all-gathers. Call on all ranks of ``group`` (``None``: the
    default group), with rank 0's paths (Lightning broadcasts ``ModelCheckpoint``'s)."""
    from lightning_zero import comm

    rank, world_size = comm.rank(group), comm.world_size(group)
    if world_size == 1 or not directories:
        return
    nodes = comm.all_gather_object(node, group) if node is not None else None
    writer_of = writers(nodes) if nodes is not None else {}
    writes = rank == 0 if node is None else node.writer
    token = f".zero-visible-{uuid.uuid4().hex[:12]}"
    markers: list[Location] = []
    error = None
    if writes:
        try:
            for directory in directories:
                markers.append(_deepest_existing(location(directory)) / token)
                with markers[-1].open("wb") as f:
                    f.write(b"lightning_zero: checking that every rank sees this directory\n")
        except OSError as exc:
            error = f"rank {rank} cannot write into the checkpoint directory: {type(exc).__name__}: {exc}"
    shared = comm.all_gather_object(([m.path for m in markers], error), group)
    failed = [e for _, e in shared if e is not None]
    if failed:
        raise ValueError(f"{failed[0]}. Give ModelCheckpoint(dirpath=...) a directory every writer can write.")
    mine_writer = 0 if node is None else writer_of[node.node]
    others = [w for n, w in writer_of.items() if node is not None and n != node.node]
    missing, crossed = [], []
    for index, directory in enumerate(directories):
        mine = location(directory)
        mine.refresh()
        missing.append(not same_place(mine, shared[mine_writer][0][index]).exists())
        # a writer sees the marker of another node's writer in the same directory: shared storage
        here = posixpath.dirname(shared[mine_writer][0][index])
        crossed.append(
            writes
            and any(
                posixpath.dirname(shared[w][0][index]) == here and same_place(mine, shared[w][0][index]).exists()
                for w in others
            )
        )
    seen = comm.all_gather_object((missing, crossed), group)
    # Two directories may share a marker (the same dirpath in two callbacks, or two directories not
    # made yet under one parent): remove each once.
    for path in dict.fromkeys(m.path for m in markers):
        marker = next(m for m in markers if m.path == path)
        with contextlib.suppress(FileNotFoundError):
            marker.fs.rm(marker.path)
    for index, directory in enumerate(directories):
        if nodes is not None:
            sharing = sorted({nodes[r].node for r, (_, flags) in enumerate(seen) if flags[index]})
            if sharing:
                raise shared_storage_error(location(directory), sharing)
        blind = [r for r, (flags, _) in enumerate(seen) if flags[index]]
        if blind:
            where = same_place(location(directory), shared[mine_writer][0][index]).parent
            raise ValueError(
                f"ranks {blind} (of {world_size}) cannot see the checkpoint directory {directory}: "
                + ("rank 0" if node is None else "their node's writer (local rank 0)")
                + f" wrote a marker file into {where} at setup and they do not find it, so they do not share the "
                "storage that holds it (a node-local disk, or a directory that exists on rank 0's node only). "
                f"Every rank writes its own file into each checkpoint. {WAYS_OUT}"
            )
