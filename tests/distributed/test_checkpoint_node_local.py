"""Node-local checkpoint storage, on 2 spawned CPU/gloo ranks that Lightning sees as two
nodes of one process each (``GROUP_RANK`` and ``LOCAL_RANK`` as ``torchrun --nnodes 2
--nproc-per-node 1`` sets them, see test_launchers.py), each in its own working directory, so a
relative checkpoint path names a different directory on each "node", as ``/local_ssd/ck`` does on a
cluster. One spawn checks: a node-local save leaves on each node only its own rank's file (plus
``lightning.pt`` and ``metadata.json``); a resume from each node's own directory is bit-exact against
the uninterrupted run; a rank whose file is missing from its node raises on every rank, naming it;
two nodes writing into one directory are found at setup; and, without a process group, the union of
the nodes' directories consolidates to exactly what a shared-directory checkpoint of the same run
consolidates to (the Python API and the CLI), while a union that misses or repeats a rank is refused.
(Without the option, ranks that cannot see rank 0's directory: test_checkpoint_io.py.)
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_zero.testing import run_ranks
from tests.helpers.checkpoint import DropoutModel, error_text, replay_loader
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed


class SaveEachEpoch(Callback):
    """``trainer.save_checkpoint(pattern)`` at the end of every epoch, where ``ModelCheckpoint`` saves:
    with a relative ``pattern`` each node resolves it in its own working directory (``ModelCheckpoint``
    would hand rank 0's absolute directory to every rank)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.pattern.format(epoch=trainer.current_epoch))


def _fit(
    node_local: bool, rank: int, ckpt_path: str | None = None, callbacks: tuple = ()
) -> tuple[pl.Trainer, list[float]]:
    from lightning_zero import ZeroStrategy

    pl.seed_everything(7, verbose=False)
    model = DropoutModel()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=ZeroStrategy(stage=2, reduce_bucket_size=50, node_local_storage=node_local),
        precision="32-true",
        max_steps=8,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(cb, pl.callbacks.ModelCheckpoint) for cb in callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=replay_loader(rank, 2), ckpt_path=ckpt_path)
    return trainer, model.losses


def _worker(rank: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    # One process per node: Lightning's TorchElasticEnvironment takes the node from GROUP_RANK and the
    # rank on it from LOCAL_RANK (run_ranks starts both ranks as one node of two).
    os.environ.update(GROUP_RANK=str(rank), NODE_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.makedirs(f"{tmp}/node{rank}")
    os.chdir(f"{tmp}/node{rank}")
    _, reference = _fit(False, rank, callbacks=(SaveEachEpoch(f"{tmp}/shared/epoch{{epoch}}.ckpt"),))
    _, node_local = _fit(True, rank, callbacks=(SaveEachEpoch("ck/epoch{epoch}.ckpt"),))
    listing = sorted(os.listdir("ck/epoch0.ckpt"))
    trainer, resumed = _fit(True, rank, ckpt_path="ck/epoch0.ckpt")  # each node reads its own directory only

    torch.distributed.barrier()
    if rank == 1:
        os.rename("ck/epoch0.ckpt/rank-00001.pt", "moved.pt")
    torch.distributed.barrier()
    missing = error_text(lambda: _fit(True, rank, ckpt_path="ck/epoch0.ckpt"))
    # ModelCheckpoint gives every rank rank 0's absolute directory: on this one machine both "nodes"
    # would write into it.
    both = error_text(lambda: _fit(True, rank, callbacks=(ModelCheckpoint(dirpath=f"{tmp}/both", every_n_epochs=1),)))
    trainer.strategy.remove_checkpoint("ck/epoch0.ckpt")  # as save_top_k does: each node removes its own
    return {
        "removed": not os.path.exists("ck/epoch0.ckpt") and os.path.isdir("ck/epoch1.ckpt"),
        "reference": reference,
        "node_local": node_local,
        "resumed": resumed,
        "listing": listing,
        "missing": missing,
        "both": both,
    }


def test_node_local_save_resume_and_consolidate(tmp_path):
    from lightning_zero.checkpoint import consolidate
    from lightning_zero.cli import main

    results = run_ranks(_worker, str(tmp_path))
    for rank, res in enumerate(results):
        # Tolerance 0: the same seed, data, steps and arithmetic; saving does not touch the training
        # state, and the resume restores every value and random state bit for bit.
        assert res["node_local"] == res["reference"]
        assert res["resumed"] == res["reference"][4:]
        # Each node's directory has its own rank's file only, and what rank 0 writes once elsewhere.
        assert res["listing"] == ["lightning.pt", "metadata.json", f"rank-{rank:05d}.pt"]
        assert "rank 1's shard file" in res["missing"] and "is missing" in res["missing"], res["missing"]
        assert f"{tmp_path}/node1/ck/epoch0.ckpt/rank-00001.pt" in res["missing"] and "node 1" in res["missing"]
        assert res["both"].startswith("ValueError: node_local_storage=True, but nodes [0, 1] see each other"), res
        assert "node_local_storage=False" in res["both"]
        assert res["removed"]
    assert results[0]["missing"].startswith("ValueError: loading the checkpoint ck/epoch0.ckpt failed on other ranks")

    nodes = [tmp_path / f"node{n}" / "ck" / "epoch1.ckpt" for n in range(2)]
    meta = json.loads((nodes[1] / "metadata.json").read_text())
    assert meta["rank_nodes"] == [0, 1] and meta == json.loads((nodes[0] / "metadata.json").read_text())
    # The frozen layer (not partitioned) is written by rank 0, and copied once onto node 1.
    assert meta["params"]["frozen.weight"]["copies"] == [[1, 0, 0, meta["params"]["frozen.weight"]["pieces"][0][3]]]

    consolidate(tmp_path / "shared" / "epoch1.ckpt", tmp_path / "shared.pt", dtype=None)
    consolidate(nodes, tmp_path / "union.pt", dtype=None)
    assert main(["consolidate", *map(str, nodes), str(tmp_path / "cli.pt"), "--dtype", "saved"]) == 0
    shared = torch.load(tmp_path / "shared.pt", weights_only=True)
    for name in ("union.pt", "cli.pt"):
        union = torch.load(tmp_path / name, weights_only=True)
        assert union.keys() == shared.keys() and all(torch.equal(union[k], shared[k]) for k in shared), name
    with pytest.raises(ValueError, match=r"the files of ranks \[1\] are in none of them"):
        consolidate(nodes[:1], tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"ranks \[1\] have a file in more than one"):
        consolidate([*nodes, nodes[1]], tmp_path / "x.pt")
