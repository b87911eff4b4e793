"""memory_breakdown() on a CUDA device with an offloaded optimizer counts the pinned host copies of
the gradient slices (what the CPU optimizer reads) as host gradients, and the staging copies of the
updated 16-bit slices as host parameters.

Skipped (with the reason in the -ra summary) without a CUDA device."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none found"),
]


def test_offloaded_gradient_copies_are_counted_on_the_host():
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    seen: dict[str, dict[str, int]] = {}

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(33, 65), nn.GELU(), nn.Linear(65, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def on_train_batch_end(self, *args) -> None:
            seen.update(self.trainer.strategy.memory_breakdown())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = TensorDataset(torch.randn(16, 33), torch.randn(16, 3))
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=ZeroStrategy(stage=2, offload_optimizer=True),
        precision="bf16-mixed",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    numel = sum(p.numel() for p in model.parameters())
    trainer.fit(model, DataLoader(data, batch_size=4))
    # one rank: the host copy holds every gradient element in bf16 (2 bytes), padding aside
    assert seen["host"]["gradients"] >= 2 * numel, seen
    # and the kernel's pinned staging copy of the updated bf16 slice, one per buffer, kept after a step
    assert seen["host"]["parameters"] >= 2 * numel, seen
