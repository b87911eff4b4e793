"""The Trainer strategy's checkpoint writing: sharded directories (every rank its own file), the
full format (one Lightning checkpoint file from rank 0, its pieces gathered in memory), async saves published at step boundaries,
node-local storage, and removal of replaced checkpoints. A mixin of
:class:`lightning_zero.ZeroStrategy`, kept apart so that the strategy file holds Lightning's hooks;
``_Saving`` names what it uses of the strategy."""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zero import comm
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint import save as ckpt_save
from lightning_zero.checkpoint.consolidate import write_file
from lightning_zero.checkpoint.full import gather_full

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_zero.config import StrategyConfig
    from lightning_zero.parallel.setup import ParallelSetup
    from lightning_zero.precision import OffloadPrecision
    from lightning_zero.zero import ZeroEngine


class _Saving(Protocol):
    """What :class:`CheckpointWriting` reads of the strategy it is mixed into."""

    config: StrategyConfig
    _engine: ZeroEngine | None
    _pending_save: ckpt_save.PendingSave | None
    _save_buffer: ckpt_save.HostBuffer
    _deletions: list[threading.Thread]
    _module_state_out: dict[str, Any] | None
    _parallel: ParallelSetup

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]: ...
    @property
    def precision_plugin(self) -> OffloadPrecision: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    def _complete_moved_module_state(self, checkpoint: dict[str, Any]) -> None: ...
    def _finish_pending_save(self, abandon: bool = False) -> None: ...
    def _in_fit(self) -> bool: ...
    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any, background: bool = False) -> None: ...
    def _node(self) -> ckpt_io.NodeRanks | None: ...
    def _save_full(self, checkpoint: dict[str, Any], path: Any) -> None: ...


class CheckpointWriting:
    """``save_checkpoint`` and ``remove_checkpoint`` of the Trainer strategy, and the async save's
    bookkeeping (see the module docstring)."""

    _pending_save: ckpt_save.PendingSave | None  # an async save not yet published
    _module_state_out: dict[str, Any] | None  # the last lightning_module_state_dict() (stage 3, sharded)

    def save_checkpoint(
        self: _Saving, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write a sharded checkpoint directory, every rank its own file (see :mod:`lightning_zero.checkpoint.save`),
        or with ``state_dict_type="full"`` one Lightning checkpoint file from rank 0 (a local path or
        any fsspec URL, as DDP writes). Before ``fit``
        (no process group yet: every rank holds the same whole model) only global rank 0 writes."""
        if storage_options is not None:
            raise TypeError(
                "ZeroStrategy.save_checkpoint(storage_options=...) is not supported: it does not use a CheckpointIO."
            )
        if not comm.initialized() and not self.is_global_zero:
            return
        if self._engine is not None:
            self._engine.check_saveable()  # after fit under nvme restore_after_fit=False: nothing left to save
        if self.config.checkpoint.state_dict_type == "full":
            self._module_state_out = None  # rank 0's module state is whole already
            ckpt_io.location(filepath)  # an unknown protocol raises on every rank alike, before any work
            if not comm.initialized():
                # Before fit nothing is partitioned: Lightning's dict is the whole checkpoint, written
                # as DDP writes it (one torch.save).
                write_file(filepath, functools.partial(torch.save, checkpoint))
                return
            self._save_full(checkpoint, filepath)
            return
        self._complete_moved_module_state(checkpoint)
        self._save_sharded(checkpoint, filepath, background=self.config.checkpoint.async_save)

    def _finish_pending_save(self: _Saving, abandon: bool = False) -> None:
        """Publish the async save still being written (all ranks), or with ``abandon`` only wait for
        this rank's writer (local). The next save waits for the previous one: one copy in host memory."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        if abandon:
            pending.wait()
        else:
            ckpt_save.commit_save(pending)

    def _async_save_at_step_boundary(self: _Saving) -> None:
        """At the start of a training batch: reserve the async save's host copy once the optimizer
        states exist, and publish an async save whose writers have all finished."""
        if (
            self.config.checkpoint.async_save
            and not self._save_buffer.reserved
            and self._engine is not None
            and self.lightning_module is not None
            and self.lightning_module.trainer.global_step > 0
        ):
            # after the first optimizer step (the states exist): the host copy's memory, allocated in a thread
            ckpt_save.reserve_host_buffer(self._save_buffer, self.lightning_module, self._engine, self.optimizers)
        if self._pending_save is not None:
            # A step boundary (every rank passes it alike): publish the async save if every rank's
            # writer has finished, raising a writer's failure on every rank; one small all-gather.
            pending, self._pending_save = self._pending_save, None
            if not ckpt_save.poll_save(pending):
                self._pending_save = pending

    def _finish_saves(self: _Saving, interrupted: bool) -> None:
        """At teardown: the end of fit publishes an async save; after a failure (``interrupted``) only
        this rank's writer is awaited (committing is a collective a crashed rank would never join): the
        save stays an unpublished temporary directory, and the previous checkpoint stays in place.
        Replaced checkpoints still being deleted are waited for."""
        self._finish_pending_save(abandon=interrupted)
        self._save_buffer = ckpt_save.HostBuffer()  # the host copy is not kept past fit
        while self._deletions:
            self._deletions.pop().join()

    def _in_fit(self: _Saving) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        return (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
            and self._engine is not None
        )

    def _save_sharded(self: _Saving, checkpoint: dict[str, Any], filepath: Any, background: bool = False) -> None:
        assert self.lightning_module is not None
        self._finish_pending_save()
        self._pending_save = ckpt_save.save_sharded(
            checkpoint,
            filepath,
            self.lightning_module,
            self._engine,
            self.optimizers,
            self.precision_plugin.precision,
            self._parallel.layout,
            # Outside fit nothing would publish it later (no step boundary, no teardown): write now.
            background=background and self._in_fit(),
            node=self._node(),
            host_buffer=self._save_buffer,
            # during fit the replaced checkpoint is deleted by a thread (joined at teardown)
            deletions=self._deletions if self._in_fit() else None,
        )

    def _node(self: _Saving) -> ckpt_io.NodeRanks | None:
        """This rank's node and local rank under node-local checkpoint storage (``None``: shared storage)."""
        if not self.config.checkpoint.node_local_storage:
            return None
        return ckpt_io.NodeRanks(self.node_rank, self.local_rank)

    def _save_full(self: _Saving, checkpoint: dict[str, Any], path: Any) -> None:
        """Every rank's pieces gathered in memory to rank 0, which writes the one plain file
        (:mod:`lightning_zero.checkpoint.full`); every rank learns whether rank 0 succeeded, so a
        failure raises everywhere instead of hanging."""
        assert self.lightning_module is not None
        self._finish_pending_save()  # an earlier async sharded save of a second ModelCheckpoint
        error = None
        try:
            full = gather_full(
                checkpoint, path, self.lightning_module, self._engine, self.optimizers, self._parallel.layout
            )
            if full is not None:
                write_file(path, functools.partial(torch.save, full))
        except Exception as exc:  # reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in comm.all_gather_object(error, None) if e] if comm.initialized() else [error]
        if any(errors):
            raise RuntimeError(f"writing the full checkpoint {path} failed on rank 0: {errors[0]}")

    def remove_checkpoint(self: _Saving, filepath: Any) -> None:
        # ModelCheckpoint calls this on every rank after agreeing on it; the async save it may name
        # is published first, so that the removal finds it.
        self._finish_pending_save()
        node = self._node()
        if self.is_global_zero if node is None else node.writer:  # node-local: each node removes its own copy
            ckpt_save.remove_sharded(filepath)
