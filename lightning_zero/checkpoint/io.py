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


def not_visible_error(path: Location, seen: Location, ranks: list[int], world_size: int) -> ValueError:
    """The error for ranks that do not see ``seen``, which rank 0 created for the save into ``path``."""
    return ValueError(
        f"ranks {ranks} (of {world_size}) cannot see {seen} that rank 0 created for the checkpoint {path}: the "
        "ranks do not share the storage that holds it (a node-local disk, a directory that exists on rank 0's node "
        "only, or a memory:// filesystem, which lives in one process). Every rank writes its own file into the "
        "checkpoint, so put checkpoints (Trainer(default_root_dir=...), ModelCheckpoint(dirpath=...), "
        "trainer.save_checkpoint(...)) on a filesystem all nodes mount at the same path (NFS, Lustre, GPFS) or on "
        "an object store every node reaches (s3://, gs://, az://)."
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


def check_shared(directories: list[PathLike], group: Any) -> None:
    """Before training: rank 0 writes a marker file into each checkpoint directory, every rank looks
    for it, and ranks that do not see it get a ``ValueError`` naming them, the directory and the ways
    out (on every rank alike, so none waits). Two small all-gathers. Call on all ranks of ``group``
    (``None``: the default group), with rank 0's paths (Lightning broadcasts ``ModelCheckpoint``'s)."""
    from lightning_zero import comm

    rank, world_size = comm.rank(group), comm.world_size(group)
    if world_size == 1 or not directories:
        return
    token = f".zero-visible-{uuid.uuid4().hex[:12]}"
    markers: list[Location] = []
    error = None
    if rank == 0:
        try:
            for directory in directories:
                markers.append(_deepest_existing(location(directory)) / token)
                with markers[-1].open("wb") as f:
                    f.write(b"lightning_zero: checking that every rank sees this directory\n")
        except OSError as exc:
            error = f"rank 0 cannot write into the checkpoint directory: {type(exc).__name__}: {exc}"
    shared = comm.all_gather_object(([m.path for m in markers], error), group)[0]
    if shared[1] is not None:
        raise ValueError(f"{shared[1]}. Give ModelCheckpoint(dirpath=...) a directory rank 0 can write.")
    missing = []
    for directory, path in zip(directories, shared[0], strict=True):
        mine = location(directory)
        mine.refresh()
        missing.append(not same_place(mine, path).exists())
    seen = comm.all_gather_object(missing, group)
    # Two directories may share a marker (the same dirpath in two callbacks, or two directories not
    # made yet under one parent): remove each once.
    for path in dict.fromkeys(m.path for m in markers):
        marker = next(m for m in markers if m.path == path)
        with contextlib.suppress(FileNotFoundError):
            marker.fs.rm(marker.path)
    for index, directory in enumerate(directories):
        blind = [r for r, flags in enumerate(seen) if flags[index]]
        if blind:
            where = same_place(location(directory), shared[0][index]).parent
            raise ValueError(
                f"ranks {blind} (of {world_size}) cannot see the checkpoint directory {directory}: rank 0 wrote a "
                f"marker file into {where} at setup and they do not find it, so they do not share the storage that "
                "holds it (a "
                "node-local disk, or a directory that exists on rank 0's node only). Every rank writes its own file "
                "into each checkpoint. Two ways out: put checkpoints (ModelCheckpoint(dirpath=...), "
                "Trainer(default_root_dir=...)) on a filesystem all nodes mount at the same path (NFS, Lustre, GPFS), "
                "or on an object store every node reaches (s3://, gs://, az://; see the README's Checkpoints section)."
            )
