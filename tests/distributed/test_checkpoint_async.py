"""Asynchronous save, on 2 spawned CPU/gloo ranks: checkpoints written by background threads
are bit for bit those of synchronous saves and resume the same; the end of fit waits for (and
publishes) the last one; a write that fails in the background raises on every rank with the rank and
the file's name, and the previous checkpoint at that path stays loadable, no temporary directory left.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.checkpoint import fit_dropout

pytestmark = pytest.mark.distributed
ZERO2 = {"stage": 2, "reduce_bucket_size": 50}
ASYNC = {**ZERO2, "async_save": True}


class _SaveAt(pl.Callback):
    """Saves to one path at steps 2 and 4 (inside fit, so asynchronous); at step 4 rank ``failing``'s
    writer raises, as a full disk would."""

    def __init__(self, path: str, failing: int | None) -> None:
        self.path, self.failing = path, failing

    def on_train_batch_end(self, trainer, *args) -> None:
        from lightning_zero.checkpoint import save

        if trainer.global_step == 4 and trainer.global_rank == self.failing:

            def failing_write(obj, file: Path) -> int:
                Path(file).write_bytes(b"partial")
                raise OSError(28, "No space left on device", str(file))

            save._write = failing_write
        if trainer.global_step in (2, 4):
            trainer.save_checkpoint(self.path)


def _worker(rank: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero.checkpoint import save

    runs = {}
    for name, spec in (("sync", ZERO2), ("async", ASYNC)):
        every_epoch = ModelCheckpoint(dirpath=f"{tmp}/{name}", every_n_epochs=1, save_top_k=-1)
        _, model = fit_dropout(spec, 2, rank, 8, callbacks=[every_epoch])
        # Right after fit: the save at step 8 (the end of the last epoch, no step boundary after it)
        # was published by teardown.
        runs[name] = {"losses": model.losses, "listing": sorted(os.listdir(f"{tmp}/{name}"))}
    _, resumed = fit_dropout(ASYNC, 2, rank, 8, ckpt_path=f"{tmp}/async/epoch=0-step=4.ckpt")

    real_write = save._write
    try:
        fit_dropout(ASYNC, 2, rank, 8, callbacks=[_SaveAt(f"{tmp}/kept.ckpt", failing=1)])
        failed = "no error"
    except RuntimeError as error:
        failed = str(error)
    finally:
        save._write = real_write
    # Rank 0 removes the failed save's temporary directory before it raises (rank 1 may be ahead).
    listing = sorted(os.listdir(tmp)) if rank == 0 else None
    return {**runs, "resumed": resumed.losses, "failed": failed, "kept_listing": listing}


def test_async_save_matches_sync_and_reports_failures(tmp_path):
    from lightning_zero.checkpoint import consolidate

    results = run_ranks(_worker, str(tmp_path))
    names = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    for res in results:
        # Saving in the background changes no arithmetic of the training: equal losses.
        assert res["async"]["losses"] == res["sync"]["losses"]
        assert res["sync"]["listing"] == names and res["async"]["listing"] == names  # no .zero-tmp-* left
        # Resumed from the async checkpoint at step 4: the same steps 5..8, same arithmetic, so 1e-6
        # relative as in test_checkpoint.py.
        torch.testing.assert_close(
            torch.tensor(res["resumed"]), torch.tensor(res["sync"]["losses"][4:]), rtol=1e-6, atol=0
        )
        failed = res["failed"]
        assert "writing the sharded checkpoint" in failed and "failed on rank 1 (of 2)" in failed, failed
        assert "No space left on device" in failed and "rank-00001.pt" in failed, failed
    # Bit for bit the synchronous checkpoints (weights, optimizer states).
    for name in names:
        consolidate(tmp_path / "sync" / name, tmp_path / "sync.pt", dtype=None)
        consolidate(tmp_path / "async" / name, tmp_path / "async.pt", dtype=None)
        want = torch.load(tmp_path / "sync.pt", weights_only=True)
        got = torch.load(tmp_path / "async.pt", weights_only=True)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    assert results[0]["kept_listing"] == ["async", "kept.ckpt", "sync"]  # no .zero-tmp-* left
    # The save at step 4 failed; the one at step 2 is what the path holds, complete.
    kept = torch.load(tmp_path / "kept.ckpt" / "lightning.pt", weights_only=False)
    assert kept["global_step"] == 2
    assert (tmp_path / "kept.ckpt" / "metadata.json").is_file()
