"""The file operations of a local save (:mod:`~lightning_zero.checkpoint.save`): writes checksummed
and flushed as they go, and the renames that publish a complete directory and retire the one it replaces.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from lightning_zero.checkpoint import format as fmt
from lightning_zero.ops import checksum


class Flusher:
    """Starts a file's disk writes while it is still being written: a thread calls ``fdatasync`` each
    time ``every`` more bytes went in, so the disk works while the writer pickles and checksums the
    rest, and the final ``fsync`` waits only for the last part. (Otherwise Linux starts writing back
    only above its dirty-page threshold, a tenth of the memory: a checkpoint smaller than that is
    computed first and written to disk after, one after the other.)"""

    def __init__(self, fd: int, every: int = 64 << 20) -> None:
        self.fd, self.every, self.next = fd, every, every
        self.signal = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="lightning_zero-fdatasync", daemon=True)
        self.thread.start()

    def written(self, size: int) -> None:
        """``size`` bytes are in the file so far: start their disk writes every ``every`` bytes."""
        if size >= self.next:
            self.next = size + self.every
            self.signal.set()

    def _run(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)  # (fdatasync: Linux)
        while True:
            self.signal.wait()
            self.signal.clear()
            if self.closed:
                return
            try:
                sync(self.fd)
            except OSError:
                return  # the writer's own final fsync reports it

    def close(self) -> None:
        """Stop the thread (the writer's own ``fsync`` follows)."""
        self.closed = True
        self.signal.set()
        self.thread.join()


class Checksummed:
    """A file object that computes the CRC-32 and the size of what is written through it, ``CHUNK``
    bytes at a time (each piece is checksummed and written while it is still in the CPU's cache)."""

    CHUNK = 4 << 20

    def __init__(self, f: Any, flusher: Flusher | None = None) -> None:
        self.f = f
        self.flusher = flusher
        self.crc32 = 0
        self.size = 0

    def write(self, data: Any) -> int:
        """Checksum and write ``data`` (any buffer); returns its size in bytes."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        for start in range(0, view.nbytes, self.CHUNK):
            piece = view[start : start + self.CHUNK]
            self.crc32 = checksum.crc32(piece, self.crc32)
            self.f.write(piece)
        self.size += view.nbytes
        if self.flusher is not None:
            self.flusher.written(self.size)
        return view.nbytes

    def flush(self) -> None:
        """Flush the underlying file object."""
        self.f.flush()


def clear(path: Path) -> None:
    """Remove ``path`` (file, link or directory tree) if it exists."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def fsync_dir(path: Path) -> None:
    """Make the renames inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_into_place(tmp: Path, path: Path, deletions: list[threading.Thread] | None = None) -> None:
    """Rename the complete ``tmp`` to ``path``, moving an existing ``path`` aside first and deleting it
    (with ``deletions``: by a thread appended there, see :func:`delete_later`)."""
    old = fmt.previous_path(path)
    clear(old)
    if path.exists() or path.is_symlink():
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    if deletions is None:
        clear(old)
    elif old.exists() or old.is_symlink():
        deletions.append(delete_later(old))


def delete_later(old: Path) -> threading.Thread:
    """Delete the replaced checkpoint ``old`` off the save's critical path: renamed at once to a hidden
    name of its own (never taken for a checkpoint, and out of the next save's way), then removed by a
    daemon thread, which the caller joins later (the strategy: at the end of fit). Deleting the
    benchmark's replaced checkpoint took ~250 ms per save there, which every rank waited for in the
    publishing agreement. (A process killed meanwhile leaves the hidden ``.zero-trash-*`` directory.)"""
    trash = old.parent / f"{fmt.trash_path(old).name}-{uuid.uuid4().hex[:8]}"
    os.rename(old, trash)
    thread = threading.Thread(
        target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, name="lightning_zero-delete", daemon=True
    )
    thread.start()
    return thread
