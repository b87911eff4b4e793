"""Two optimizers under manual optimization (a GAN: generator and discriminator) at ZeRO stages 1-3,
against Lightning's DDP on 2 gloo ranks.

The hazard: the generator's loss backpropagates through the discriminator, so the discriminator's
parameters receive gradients in the generator's window, as under DDP; the next ``opt_d.zero_grad()``
must drop them (ZeRO holds them in its buckets, not in ``param.grad``). No ``toggle_optimizer``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks
from tests.helpers.parity import max_rel
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed

# odd sizes so that every flat-buffer slice cuts through a parameter
NOISE, DATA, HIDDEN = 5, 7, 13
ZERO3 = {"stage": 3, "param_persistence_threshold": 10, "prefetch_bucket_size": 200, "reduce_bucket_size": 40}


class TinyGAN(pl.LightningModule):
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


def _worker(rank: int, specs: list) -> dict:
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


def test_two_optimizers_manual_match_ddp():
    specs = [
        ("ddp", "ddp"),
        ("zero1", {"stage": 1, "reduce_bucket_size": 40}),
        ("zero2", {"stage": 2, "reduce_bucket_size": 40}),
        ("zero3", ZERO3),
    ]
    for res in run_ranks(_worker, specs):
        ref = res["ddp"]
        assert len(ref["losses"]) == 4
        for name in ("zero1", "zero2", "zero3"):
            assert len(res[name]["losses"]) == 4
            # fp32: the only differences are summation order (reduce-scatter of flat buckets vs DDP's
            # all-reduce): ~1e-7 relative per step, amplified by a few Adam steps; 1e-5 is the bound
            # of the single-optimizer parity tests (test_parity.py).
            torch.testing.assert_close(
                torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0
            )
            for key, value in ref["state"].items():
                assert max_rel(res[name]["state"][key], value) <= 1e-5, (name, key)
