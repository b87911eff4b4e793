"""3D checkpoints converted across layouts: tp2 x pp2 -> dp4 and dp4 -> tp2 x pp2 (4 CPU/gloo ranks).

The recipes' tiny GPT-2 (2 blocks, d=32, vocab 64) under its own Megatron plan: attention and MLP
split column/row, the tied token embedding and LM head split by the vocabulary. Under pp2 the
embedding lives on stage 0 and the head on stage 1, so the tied weight is split four ways (two
tensor-parallel parts on each of two stages) and must come back whole for dp4, and be re-split for
tp2 x pp2 from a dp4 checkpoint.

Data: every step reads the same global batch of 4 rows (tp2 x pp2: one data-parallel replica reads
all 4, in 2 micro-batches; dp4: a row per rank), so Lightning's restart of the epoch on resume
replays identical batches. Checkpoints: ModelCheckpoint's at the end of epoch 0 (step 2 of 4).

Tolerance: 1e-5 relative on the losses of steps 3 and 4. The layouts sum the same gradients in a
different order (per micro-batch, per tensor-parallel part, per data-parallel rank): ~1e-7 relative,
amplified by 2 AdamW steps. A part loaded into the wrong place or a tied weight taken from one side
only moves the losses by 1e-2 or more.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed

VOCAB, SEQ, ROWS, STEPS_PER_EPOCH, STEPS = 64, 16, 4, 2, 4
CHECKPOINT = "epoch=0-step=2.ckpt"


def _module():
    from lightning_zero import PipelineSpec
    from recipes.gpt2.model import GPT, TENSOR_PARALLEL_PLAN, GPTConfig

    class TinyGPT2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))
            self.losses: list[float] = []

        def tensor_parallel_plan(self) -> dict[str, str]:
            return {f"model.{k}": v for k, v in TENSOR_PARALLEL_PLAN.items()}

        def configure_pipeline(self) -> PipelineSpec:
            return PipelineSpec(
                layers=self.model.to_layers(),
                loss=lambda logits, batch: self.model.loss(logits, batch[0][:, 1:]),
                inputs=lambda batch: batch[0][:, :-1],
            )

        def training_step(self, batch, batch_idx):  # dp4 only; the pipeline runs its schedule instead
            (rows,) = batch
            return self.model.loss(self.model(rows[:, :-1]), rows[:, 1:])

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return TinyGPT2()


def _fit(rank: int, tp: int, pp: int, ckpt_path=None, save_dir=None) -> list[float]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero import ZeroStrategy

    pl.seed_everything(3, verbose=False)
    model = _module()
    data = 4 // (tp * pp)
    dp_rank = (rank // tp) % data
    rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    mine = rows[dp_rank * ROWS // data : (dp_rank + 1) * ROWS // data]
    loader = DataLoader(TensorDataset(mine.repeat(STEPS_PER_EPOCH, 1)), batch_size=len(mine))
    callbacks = [ModelCheckpoint(dirpath=save_dir, every_n_epochs=1, save_top_k=-1)] if save_dir else []
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=4,
        precision="32-true",
        max_steps=STEPS,
        callbacks=callbacks,
        strategy=ZeroStrategy(stage=1, tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_micro_batches=2),
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return model.losses


def _worker(rank: int, tmp: str) -> dict:
    three_d = _fit(rank, 2, 2, save_dir=f"{tmp}/3d")
    to_dp = _fit(rank, 1, 1, ckpt_path=f"{tmp}/3d/{CHECKPOINT}")
    dp = _fit(rank, 1, 1, save_dir=f"{tmp}/dp")
    to_3d = _fit(rank, 2, 2, ckpt_path=f"{tmp}/dp/{CHECKPOINT}")
    return {"3d": three_d, "to_dp": to_dp, "dp": dp, "to_3d": to_3d}


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")


def test_tp2_pp2_checkpoint_loads_as_dp4_and_back(tmp_path):
    from lightning_zero.checkpoint import consolidate, read_metadata

    results = run_ranks(_worker, str(tmp_path), world_size=4, timeout=420)
    # dp4: every rank holds a quarter of the batch; the step's loss is their mean.
    mean = lambda key: [sum(step) / 4 for step in zip(*(r[key] for r in results), strict=True)]  # noqa: E731 (a one-line helper)
    three_d, dp = results[0]["3d"], mean("dp")
    assert all(r["3d"] == three_d for r in results)  # every rank logs the true loss
    _close(dp, three_d, "dp4 vs tp2 x pp2 from the same weights")
    _close(mean("to_dp"), three_d[STEPS_PER_EPOCH:], "tp2 x pp2 checkpoint resumed as dp4")
    for r in results:
        _close(r["to_3d"], dp[STEPS_PER_EPOCH:], "dp4 checkpoint resumed as tp2 x pp2")
    meta = read_metadata(tmp_path / "3d" / CHECKPOINT)
    wte = meta["params"]["model.embed.wte.weight"]
    assert wte["aliases"] == ["model.head.lm_head.weight"] and wte["shape"] == [VOCAB, 32]
    consolidate(tmp_path / "3d" / CHECKPOINT, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert whole["model.embed.wte.weight"].shape == (VOCAB, 32)
