"""Where checkpoints go, on 2 spawned CPU/gloo ranks: one path for all ranks whatever their
working directories, file:// URLs through fsspec (save, ModelCheckpoint, resume), a save that fails on
one rank (every rank raises, none hangs, the previous checkpoint stays, no temporary directory is left),
a rank that cannot see rank 0's directory (ValueError naming it), and a memory:// filesystem (one per
process) found by the same check. Object stores: test_checkpoint_store.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.checkpoint import error_text, fit_dropout

pytestmark = pytest.mark.distributed
ZERO2 = {"stage": 2, "reduce_bucket_size": 50}


def _worker(rank: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero.checkpoint import consolidate, save

    # One working directory per "node": a relative path must still name rank 0's directory.
    os.makedirs(f"{tmp}/node{rank}")
    os.chdir(f"{tmp}/node{rank}")
    # (Not a file:// URL here: ModelCheckpoint itself turns one into a path under the working directory.)
    every_epoch = ModelCheckpoint(dirpath=f"{tmp}/epochs", every_n_epochs=1, save_top_k=-1)
    trainer, full = fit_dropout(ZERO2, 2, rank, 8, callbacks=[every_epoch])
    trainer.save_checkpoint("ck/final.ckpt")
    trainer.save_checkpoint(f"file://{tmp}/url.ckpt")
    _, resumed = fit_dropout(ZERO2, 2, rank, 8, ckpt_path=f"file://{tmp}/epochs/epoch=0-step=4.ckpt")
    if rank == 0:
        consolidate(f"{tmp}/node0/ck/final.ckpt", f"{tmp}/before.pt", dtype=None)
    torch.distributed.barrier()

    # A save that fails on rank 1 half-way through writing its file.
    real_write = save._write

    def failing_write(obj, file: Path) -> int:
        Path(file).write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(file))

    if rank == 1:
        save._write = failing_write
    with torch.no_grad():
        for p in full.parameters():
            p.add_(1.0)  # the failed save would differ from the saved one
    failed = error_text(lambda: trainer.save_checkpoint("ck/final.ckpt"))
    save._write = real_write
    torch.distributed.barrier()

    # Rank 1 sees another directory than rank 0 created (as on a node-local disk).
    real_tmp = save.fmt.temporary_path
    if rank == 1:
        save.fmt.temporary_path = lambda path: real_tmp(path.parent / "elsewhere" / path.name)
    blind = error_text(lambda: trainer.save_checkpoint("ck/final.ckpt"))
    save.fmt.temporary_path = real_tmp
    remote = error_text(lambda: trainer.save_checkpoint("memory://bucket/final.ckpt"))

    # At setup, before any step: rank 1 looks for rank 0's marker in another directory (a node-local disk).
    from lightning_zero.checkpoint import io as ckpt_io

    real_same = ckpt_io.same_place
    if rank == 1:
        ckpt_io.same_place = lambda mine, path: real_same(mine, path.replace(tmp, f"{tmp}/node1"))
    steps = ModelCheckpoint(dirpath=f"{tmp}/setup_ck", every_n_train_steps=1)
    at_setup = error_text(lambda: fit_dropout(ZERO2, 2, rank, 8, callbacks=[steps]))
    ckpt_io.same_place = real_same
    return {
        "full": full.losses,
        "resumed": resumed.losses,
        "failed": failed,
        "blind": blind,
        "remote": remote,
        "at_setup": at_setup,
        "url_saved": os.path.isfile(f"{tmp}/url.ckpt/metadata.json"),
        "listing": sorted(os.listdir(f"{tmp}/node{rank}")),
        "ck_listing": sorted(os.listdir(f"{tmp}/node{rank}/ck")) if os.path.isdir(f"{tmp}/node{rank}/ck") else None,
    }


def test_paths_urls_and_failed_saves(tmp_path):
    from lightning_zero.checkpoint import consolidate

    results = run_ranks(_worker, str(tmp_path))
    for res in results:
        # Resumed through a file:// URL at step 4: the same steps 5..8, same arithmetic, so 1e-6
        # relative as in test_checkpoint.py.
        torch.testing.assert_close(torch.tensor(res["resumed"]), torch.tensor(res["full"][4:]), rtol=1e-6, atol=0)
        assert "writing the sharded checkpoint" in res["failed"] and "rank 1" in res["failed"], res["failed"]
        assert "No space left on device" in res["failed"]
        assert res["blind"].startswith("ValueError: ranks [1] (of 2) cannot see "), res["blind"]
        assert ".zero-tmp-" in res["blind"] and "NFS" in res["blind"], res["blind"]
        # memory:// lives in one process: rank 1 does not see the marker rank 0 wrote there
        assert res["remote"].startswith("ValueError: ranks [1] (of 2) cannot see memory://"), res["remote"]
    for res in results:
        assert res["at_setup"].startswith("ValueError: ranks [1] (of 2) cannot see the checkpoint directory"), res
        assert f"directory {tmp_path}/setup_ck:" in res["at_setup"] and "Two ways out" in res["at_setup"], res[
            "at_setup"
        ]
        assert "node_local_storage=True" in res["at_setup"] and "NFS" in res["at_setup"]  # the two ways out
    # no checkpoint (no step ran), no directory created, the marker (in its parent) removed
    assert not (tmp_path / "setup_ck").exists() and not list(tmp_path.glob(".zero-visible-*"))
    # Rank 0's directory holds the one checkpoint; rank 1's working directory got nothing.
    assert results[0]["url_saved"]
    assert results[0]["ck_listing"] == ["final.ckpt"]  # no .zero-tmp-* left by the failed saves
    assert results[1]["listing"] == [] and results[1]["ck_listing"] is None
    assert sorted(os.listdir(tmp_path / "epochs")) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    # The previous checkpoint is intact: bit for bit what was saved before the failed saves.
    consolidate(tmp_path / "node0" / "ck" / "final.ckpt", tmp_path / "after.pt", dtype=None)
    before = torch.load(tmp_path / "before.pt", weights_only=True)
    after = torch.load(tmp_path / "after.pt", weights_only=True)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
