"""Exact mid-epoch resume: a run interrupted mid-epoch, and in the middle of a
gradient-accumulation window, and resumed with ``fit(ckpt_path=...)`` in a fresh Trainer computes
the same per-micro-batch losses as the uninterrupted run, bit for bit (fp32, CPU, 2 gloo ranks).

What it takes (see docs/checkpoints.md, "Exact resume"): a ``torchdata`` ``StatefulDataLoader`` over a torch
``RandomSampler`` (Lightning swaps in a ``DistributedSampler``, whose order depends only on the seed
and the epoch; the loader's state, saved by Lightning, skips what was consumed); the sharded
checkpoint keeps every rank's loader state and random states, and the gradients accumulated since
the last step. The model has dropout, so the random states matter; 46 rows over 2 ranks in batches
of 3 make 8 batches per epoch per rank, 3 optimizer steps with ``accumulate_grad_batches=3`` (the
last window is short), so the 6 steps cross an epoch boundary after the resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import RandomSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_zero.testing import run_ranks
from tests.helpers.models import SEQ, VOCAB, ParityModel
from tests.helpers.trainer import build_strategy, quiet_trainer

pytestmark = pytest.mark.distributed

STAGES = {
    1: {"stage": 1, "reduce_bucket_size": 50},
    2: {"stage": 2, "reduce_bucket_size": 50},
    # every parameter sharded (none kept whole by the persistence threshold), buckets cutting through them
    3: {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0},
}
MAX_STEPS, ACCUMULATE = 6, 3
MID_WINDOW = 5  # micro-batch 5 of the run: 2 of the 3 of window 2 done


class DropoutModel(ParityModel):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(tokens))
        x = x + self.down(F.dropout(torch.tanh(self.up(x)), 0.2, self.training))
        return self.head(self.norm(x))


class SaveAfterBatch(Callback):
    """Saves after the ``at``-th micro-batch of the run: where a preemption handler would save."""

    def __init__(self, at: int, path: str) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx + 1 == self.at:
            trainer.save_checkpoint(self.path)


def _loader() -> StatefulDataLoader:
    tokens = torch.randint(0, VOCAB, (46, SEQ), generator=torch.Generator().manual_seed(5))
    dataset = TensorDataset(tokens)
    return StatefulDataLoader(dataset, batch_size=3, sampler=RandomSampler(dataset))


def _fit(spec, devices: int, ckpt_path: str | None = None, callbacks=()) -> list[float]:
    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(7, verbose=False)
    model = DropoutModel()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=build_strategy(spec),
        precision="32-true",
        max_steps=MAX_STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=0.5,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
    )
    trainer.fit(model, train_dataloaders=_loader(), ckpt_path=ckpt_path)
    return model.losses


def _worker(rank: int, tmp: str, spec: dict) -> dict:
    callbacks = [
        ModelCheckpoint(dirpath=f"{tmp}/steps", every_n_train_steps=2, save_top_k=-1),
        SaveAfterBatch(MID_WINDOW, f"{tmp}/mid-window.ckpt"),
    ]
    full = _fit(spec, 2, callbacks=callbacks)
    return {
        "full": full,
        "mid_epoch": _fit(spec, 2, ckpt_path=f"{tmp}/steps/epoch=0-step=2.ckpt"),
        "mid_window": _fit(spec, 2, ckpt_path=f"{tmp}/mid-window.ckpt"),
        "saved": sorted(os.listdir(f"{tmp}/steps")),
    }


# Stage 1 saves the unreduced bucket, stages 2 and 3 the averaged grad_shard through the same code
# (FlatBuffer.window_grads); stage 3 also gathers: 1 and 3 cover both paths in half the suite time.
@pytest.mark.parametrize("stage", [1, 3])
def test_mid_epoch_and_mid_window_resume_is_bitwise_exact(tmp_path, stage):
    results = run_ranks(_worker, str(tmp_path), STAGES[stage], timeout=600)
    meta = json.loads((tmp_path / "mid-window.ckpt" / "metadata.json").read_text())
    assert (
        meta["mid_window"]
        and not json.loads((tmp_path / "steps/epoch=0-step=2.ckpt/metadata.json").read_text())["mid_window"]
    )
    for res in results:
        assert res["saved"] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt"]
        assert len(res["full"]) == 16  # 8 micro-batches of epoch 0 (3 steps) and 8 of epoch 1
        # Bitwise: the same batches, weights, optimizer states, random states and partial gradients,
        # so every float op repeats exactly. Step 2 ended with micro-batch 6; the mid-window save
        # came after micro-batch 5.
        assert res["mid_epoch"] == res["full"][6:]
        assert res["mid_window"] == res["full"][MID_WINDOW:]


def _other_world_worker(rank: int, tmp: str, spec: dict) -> dict:
    losses = _fit(spec, 1, ckpt_path=f"{tmp}/steps/epoch=0-step=2.ckpt")
    with pytest.raises(ValueError, match="middle of a gradient-accumulation window"):
        _fit(spec, 1, ckpt_path=f"{tmp}/mid-window.ckpt")
    return {"losses": losses}


def test_resume_at_another_world_size(tmp_path):
    """At another world size: a window-boundary checkpoint resumes (each rank skips as many of its own
    batches as the saving ranks had consumed: the documented closest behaviour), a mid-window one is
    refused with the fix in the message."""
    run_ranks(_worker, str(tmp_path), STAGES[2], timeout=600)
    (res,) = run_ranks(_other_world_worker, str(tmp_path), STAGES[2], world_size=1, timeout=300)
    # 1 rank: 46 rows in batches of 3 = 16 batches per epoch. Resumed after 2 steps (6 batches skipped):
    # steps 3-5 take batches 7-15 and step 6 the epoch's last batch alone (Lightning steps on the last
    # batch): 10 more micro-batches.
    assert len(res["losses"]) == 10 and all(torch.isfinite(torch.tensor(res["losses"])))
    assert Path(tmp_path / "mid-window.ckpt").is_dir()
