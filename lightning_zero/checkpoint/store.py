"""Publishing a save on a filesystem without rename (an object store): ``metadata.json`` written last.

On the local filesystem a save is published by renaming its hidden directory
(:mod:`~lightning_zero.checkpoint.save`). S3, GCS and Azure Blob have no rename (fsspec's ``mv`` is a
copy and a delete), but they write one object atomically: a reader sees a whole object or none. So
a save into ``PATH`` on a store goes::

    rank 0     PARENT/.zero-tmp-HASH          a pending marker naming the checkpoint being written
    all ranks  PATH/files-ID/rank-RRRRR.pt    each rank streams its own file through fsspec's writer
    rank 0     PATH/files-ID/lightning.pt     (one write buffer in memory: a multipart upload on S3)
    rank 0     PATH/metadata.json             once every rank reported its file written: the commit;
                                              it names the files of this save (``files-ID/...``)
    rank 0     deletes PATH's other files-* prefixes (the checkpoint this save replaced), then the marker

A reader takes ``PATH`` for a checkpoint only through ``metadata.json``
(:func:`~lightning_zero.checkpoint.format.resolve`; a prefix without it raises a ``ValueError``
naming it), so a kill at any moment leaves the previous ``metadata.json`` with its files (still there)
or the new one with its files. ``ID`` is new for every save, so a save never overwrites a file the
current ``metadata.json`` names. What a killed save left (its marker, its ``files-ID`` prefix) is
removed at the next save into the same directory :func:`begin`, whatever checkpoint name that save
has: every pending marker in the directory is taken for a killed save's, so two runs must not save
into one directory at once (nor should they: ``ModelCheckpoint`` would delete each other's files).

All storage is fsspec's and the user's filesystem package's (``s3fs``, ``gcsfs``, ``adlfs``); this
module is only the order of the writes and deletes.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint.io import Location

FILES_PREFIX = "files-"
MARKER_PREFIX = ".zero-tmp-"


def files_dir(path: Location, save_id: str) -> Location:
    """Where the save ``save_id`` into ``path`` writes its files."""
    return path / f"{FILES_PREFIX}{save_id}"


def _names(directory: Location) -> list[str]:
    """The entries of ``directory`` (names, not paths); none when it does not exist."""
    try:
        return [posixpath.basename(entry.rstrip("/")) for entry in directory.fs.ls(directory.path, detail=False)]
    except FileNotFoundError:
        return []


def _remove(target: Location) -> None:
    if target.exists():
        target.fs.rm(target.path, recursive=True)


def _referenced(path: Location) -> str | None:
    """The ``files-ID`` prefix that ``path``'s ``metadata.json`` names (``None`` without one)."""
    meta = fmt._read_format(path)
    return None if meta is None else posixpath.dirname(fmt.lightning_file(meta)) or None


def prune(path: Location) -> None:
    """Delete every ``files-*`` prefix of ``path`` that its ``metadata.json`` does not name (all of them
    when it has none: a save that never committed)."""
    keep = _referenced(path)
    for name in _names(path):
        if name.startswith(FILES_PREFIX) and name != keep:
            _remove(path / name)


def clean_stale(parent: Location) -> None:
    """Remove what killed saves into ``parent`` left: for each pending marker, the unreferenced files
    of the checkpoint it names, then the marker."""
    for name in _names(parent):
        if not name.startswith(MARKER_PREFIX):
            continue
        marker = parent / name
        try:
            with marker.open("rb") as f:
                target = json.loads(f.read())["checkpoint"]
        except (OSError, ValueError, KeyError, TypeError):
            target = None  # a marker cut short by the kill: nothing to follow
        if isinstance(target, str) and target and "/" not in target:
            prune(parent / target)
        _remove(marker)


def begin(path: Location, save_id: str) -> Location:
    """Rank 0, before any rank writes: clean up after killed saves and write this save's pending
    marker (which the other ranks look for: they must see the same store). Returns the marker."""
    path.refresh()
    clean_stale(path.parent)
    marker = fmt.temporary_path(path)
    with marker.open("wb") as f:
        f.write(json.dumps({"checkpoint": path.name, "files": files_dir(path, save_id).name}).encode())
    return marker


def commit(path: Location, marker: Location, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its file: write ``metadata.json`` (the commit), then delete the
    replaced checkpoint's files and the marker."""
    fmt.write_metadata(path, meta)
    path.refresh()
    prune(path)
    _remove(marker)


def abort(files: Location, marker: Location) -> None:
    """Rank 0, after a failed save: delete its files and its marker (the previous checkpoint stays)."""
    files.refresh()
    _remove(files)
    _remove(marker)


def remove(path: Location) -> None:
    """Delete the checkpoint at ``path``: ``metadata.json`` first, so a half-deleted prefix is never
    taken for a checkpoint."""
    _remove(path / fmt.METADATA_FILE)
    _remove(path)
