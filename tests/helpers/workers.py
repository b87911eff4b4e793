"""Rank workers that several test files run with other strategies: the checkpoint-resume round trip
of :class:`~tests.helpers.models.ParityModel` and the two-optimizer GAN under manual optimization."""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import make_loader, state
from tests.helpers.trainer import fit, quiet_trainer

# the GAN's odd sizes, so that every flat-buffer slice cuts through a parameter
NOISE, DATA, HIDDEN = 5, 7, 13


def resume_worker(rank: int, tmp: str, first: object, second: object, precision: str, optimizer: str = "adamw") -> dict:
    """8 steps under strategy ``first`` with a checkpoint at step 4, then a resume from it to step 8
    under ``second`` (a sharded checkpoint is converted first when ``second`` is DDP); both runs'
    losses and final states, which a caller compares."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    # 12 rows / batch 3 = 4 optimizer steps per epoch on each rank. The default ModelCheckpoint
    # writes at the end of epoch 0 (step 4) during the uninterrupted 8-step run; the second run
    # resumes from it. Lightning restarts a plain DataLoader's epoch on resume, so every row of a
    # rank is the same (rank-specific) row and the batches replay identically wherever Lightning
    # resumes; no accumulation, because Lightning also restarts the accumulation window.
    every_epoch = ModelCheckpoint(dirpath=tmp, every_n_epochs=1, save_top_k=-1)
    loader = make_loader(n=12, seed=1000 + rank, period=1)
    common = {"precision": precision, "accumulate": 1, "loader": loader, "model_kwargs": {"optimizer": optimizer}}
    no_sampler = {"use_distributed_sampler": False}
    with_ckpt = {"callbacks": [every_epoch], "enable_checkpointing": True, **no_sampler}
    trainer, full = fit(first, max_steps=8, trainer_kwargs=with_ckpt, **common)
    path = f"{tmp}/epoch=0-step=4.ckpt"
    full_file = isinstance(first, dict) and first.get("state_dict_type") == "full"
    if full_file:  # one ordinary Lightning file, readable without lightning_zero
        import os

        loaded = torch.load(path, weights_only=False, map_location="cpu")
        assert os.path.isfile(path) and "embed.weight" in loaded["state_dict"], sorted(loaded)
        assert not any(p.name.startswith(".") for p in __import__("pathlib").Path(tmp).iterdir())  # no staging
        # a weights-only save (ModelCheckpoint(save_weights_only=True)) has no optimizer states, as DDP's
        # (in a folder of its own: the other rank may still be looking for staging directories in tmp)
        os.makedirs(f"{tmp}/weights", exist_ok=True)
        trainer.save_checkpoint(f"{tmp}/weights/last.ckpt", weights_only=True)
        weights = torch.load(f"{tmp}/weights/last.ckpt", weights_only=True)
        assert "optimizer_states" not in weights and "embed.weight" in weights["state_dict"], sorted(weights)
    if second == "ddp" and first != "ddp" and not full_file:
        from lightning_zero.checkpoint import to_lightning_checkpoint

        # DDP reads one file: the sharded directory is converted first (what
        # `lightning-zero consolidate --lightning` does); one copy per rank, so no barrier is needed.
        to_lightning_checkpoint(path, f"{tmp}/plain-{rank}.ckpt")
        path = f"{tmp}/plain-{rank}.ckpt"
    _, resumed = fit(second, max_steps=8, ckpt_path=path, trainer_kwargs=no_sampler, **common)
    return {"full": full.losses, "resumed": resumed.losses, "full_state": state(full), "resumed_state": state(resumed)}


class TinyGAN(pl.LightningModule):
    """A generator and a discriminator with an optimizer each, stepped by hand; the generator's loss
    backpropagates through the discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DATA))
        self.discriminator = nn.Sequential(nn.Linear(DATA, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))
        self.losses: list[tuple[float, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        # the noise depends on the step and rank only, identical under DDP and ZeRO
        gen = torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        noise = torch.randn(real.shape[0], NOISE, generator=gen)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        fake = self.generator(noise)
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(real), ones
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        # through the discriminator: its parameters get gradients here too, dropped by opt_d.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(noise)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.losses.append((d_loss.item(), g_loss.item()))

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-2, betas=(0.5, 0.999))
        opt_d = torch.optim.AdamW(self.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.99), weight_decay=0.01)
        return opt_g, opt_d


def gan_worker(rank: int, specs: list) -> dict:
    """:class:`TinyGAN` for 4 batches under each ``(name, spec)`` of ``specs`` (``"ddp"`` or ZeroStrategy
    arguments); per name, the losses and the final (gathered) state."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    real = torch.randn(24, DATA, generator=torch.Generator().manual_seed(3)) * 0.5 + 1.0
    out = {}
    for name, spec in specs:
        pl.seed_everything(7, verbose=False)
        model = TinyGAN()
        strategy = DDPStrategy(find_unused_parameters=True) if spec == "ddp" else ZeroStrategy(**spec)
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=8,  # Lightning counts both optimizers' steps: 4 batches
        )
        trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(real), batch_size=3))
        with trainer.strategy.gathered_parameters() if spec != "ddp" else contextlib.nullcontext():
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[name] = {"losses": model.losses, "state": weights}
    return out
