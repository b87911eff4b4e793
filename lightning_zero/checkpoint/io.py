"""Where a checkpoint goes: one path for all ranks, URLs, and the check that every rank can see it.

Every rank of a save writes under the directory **rank 0** resolved (``~`` expanded, a relative path
taken from rank 0's working directory), as Lightning does under DDP: ranks started from different
working directories (one per node) still write one checkpoint. The resolved path travels in the
save's first agreement (:mod:`~lightning_zero.checkpoint.save`), so this costs no extra collective.

A path may be a URL that fsspec (a Lightning dependency) resolves to the local filesystem
(``file:///shared/ck``). Other filesystems (``s3://``, ``gs://``, ``memory://``, ...) are refused
with a ``ValueError`` before any work starts: the commit protocol of a save (a hidden temporary
directory renamed into place) needs a filesystem with an atomic directory rename, and the one for
stores without rename (``metadata.json`` as the commit marker of a prefix) is not written yet.

Ranks must share the filesystem that holds the checkpoint. A rank that cannot see the temporary
directory rank 0 created is found before any rank writes its file (:func:`not_visible_error`), and
the half-made temporary directory is removed.
"""

from __future__ import annotations

import os
from pathlib import Path

PathLike = str | os.PathLike


def local_path(filepath: PathLike) -> Path:
    """``filepath`` as a local, absolute, user-expanded path (resolved on the calling rank).

    Raises ``ValueError`` for a URL of a filesystem other than the local one.
    """
    text = os.fspath(filepath)
    if "://" in text:
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem

        fs, inner = url_to_fs(text)
        if not isinstance(fs, LocalFileSystem):
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            raise ValueError(
                f"cannot write or read the sharded checkpoint {text!r}: its filesystem ({protocol!r}, "
                f"{type(fs).__name__}) is not the local one, and lightning_zero's sharded checkpoints need an "
                "atomic directory rename. Use a local or shared (NFS, Lustre, ...) path or a file:// URL, and copy "
                "the finished checkpoint directory to the object store afterwards."
            )
        text = inner
    return Path(text).expanduser().absolute()


def not_visible_error(path: Path, tmp: Path, ranks: list[int], world_size: int) -> ValueError:
    """The error for ranks that do not see ``tmp``, which rank 0 created for the save into ``path``."""
    return ValueError(
        f"ranks {ranks} (of {world_size}) cannot see the directory {tmp} that rank 0 created for the checkpoint "
        f"{path}: the ranks do not share the filesystem that holds it (a node-local disk, or a directory that "
        "exists on rank 0's node only). Every rank writes its own file into the checkpoint directory, so put "
        "checkpoints (Trainer(default_root_dir=...), ModelCheckpoint(dirpath=...), trainer.save_checkpoint(...)) on "
        "a filesystem all nodes mount at the same path (NFS, Lustre, GPFS)."
    )
