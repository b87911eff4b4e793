"""The last two steps of a sharded save (:class:`~lightning_zero.checkpoint.save.ShardedSave`): a
written save, its rank files possibly still being written by a thread (:class:`PendingSave`), is
committed (:func:`commit`: every rank's write agreed; a failure anywhere removes the temporary files)
and published (:func:`publish`: the writer writes ``metadata.json`` last and renames the directory
into place, or on a store commits its marker: :mod:`~lightning_zero.checkpoint.store`).

An asynchronous save is published at the first step boundary that finds every rank's writer done
(:func:`poll_save`), or when the strategy must wait for it (:func:`commit_save`); until then the
previous checkpoint at the path stays as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_zero import comm
from lightning_zero.checkpoint import files, store
from lightning_zero.checkpoint import format as fmt
from lightning_zero.checkpoint.agreement import agree, guarded
from lightning_zero.checkpoint.io import Location


@dataclass(eq=False)
class PendingSave:
    """A save whose files are written by a background thread (``save_sharded(background=True)``);
    published by :func:`commit_save` once every rank's thread has finished."""

    path: Location
    """The checkpoint directory (rank 0's resolution)."""
    tmp: Location
    """Where the rank files are written: locally the hidden temporary directory, on a store the
    save's ``files-ID`` prefix (:mod:`~lightning_zero.checkpoint.store`)."""
    marker: Location | None
    """On a store, the pending marker rank 0 wrote (``None`` locally)."""
    rank: int
    writes: bool
    """Whether this rank publishes (rank 0; under node-local storage each node's local rank 0)."""
    group: comm.ProcessGroup
    meta: Callable[[list[tuple[int, int, int | None]]], dict[str, Any]]
    """``metadata.json``'s contents, given every rank's file size."""
    outcome: tuple[bool, Any] | None = None
    """``(True, file size)`` or ``(False, traceback)`` once the writer finished."""
    deletions: list[threading.Thread] | None = None
    """Where the deletion of the replaced checkpoint goes (``None``: deleted before publishing returns)."""
    thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, write: Callable[[], tuple[int, int, int | None]]) -> None:
        def run() -> None:
            self.outcome = guarded(write)

        self.thread = threading.Thread(target=run, name=f"lightning_zero-save-rank{self.rank}", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        """Whether this rank's writer has finished (local, no communication)."""
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> None:
        """Wait for this rank's writer (local, no communication)."""
        if self.thread is not None:
            self.thread.join()


def discard(writes: bool, tmp: Location, marker: Location | None) -> None:
    """A writer (rank 0, or a node's local rank 0): remove a failed save's files (locally its temporary
    directory ``tmp``; on a store its prefix ``tmp`` and ``marker``). Other ranks: nothing."""
    if not writes:
        return
    if marker is not None:
        store.abort(tmp, marker)
    else:
        files.clear(tmp.as_path())


def commit(pending: PendingSave) -> list[tuple[int, int, int | None]]:
    """Wait for this rank's writer and agree on every rank's outcome: every rank's ``(file size,
    CRC-32, lightning.pt's CRC-32)``. A failed write on any rank raises on every rank, naming it, and
    the writer removes the temporary files. Call on all ranks, from the main thread."""
    pending.wait()
    assert pending.outcome is not None
    try:
        return agree(
            pending.outcome, pending.group, f"writing the sharded checkpoint {pending.path} (files in {pending.tmp})"
        )
    except RuntimeError:
        # Every rank has reported, so no rank still writes into tmp: remove the partial save (the
        # previous checkpoint at ``path`` was never touched).
        discard(pending.writes, pending.tmp, pending.marker)
        raise


def publish(pending: PendingSave, written: list[tuple[int, int, int | None]]) -> None:
    """The writer writes ``metadata.json`` last and renames the directory into place (on a store:
    commits the marker); the outcome is agreed, so a failure raises on every rank. Call on all ranks."""
    path, tmp = pending.path, pending.tmp

    def finish() -> None:
        if pending.marker is not None:
            store.commit(path, pending.marker, pending.meta(written))
            return
        fmt.write_metadata(tmp, pending.meta(written))
        files.rename_into_place(tmp.as_path(), path.as_path(), pending.deletions)

    ok = guarded(finish) if pending.writes else (True, None)
    agree(ok, pending.group, f"publishing the sharded checkpoint {path}")


def commit_save(pending: PendingSave) -> None:
    """:func:`commit` then :func:`publish`: a written save becomes the checkpoint at its path, or fails
    on every rank leaving the previous one. Call on all ranks, from the main thread."""
    publish(pending, commit(pending))


def poll_save(pending: PendingSave) -> bool:
    """Commit ``pending`` if every rank's writer has finished (one small all-gather; True then), else
    leave it (False). Call on all ranks, from the main thread."""
    if not all(comm.all_gather_object(pending.done(), pending.group)):
        return False
    commit_save(pending)
    return True
