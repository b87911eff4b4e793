"""The same parameter in two optimizers (a conditional GAN whose label embedding both the generator's
and the discriminator's optimizer hold) at ZeRO stages 1-3 and with an offloaded optimizer, against
Lightning's DDP on 2 gloo ranks; then a save and resume, and the checkpoint consolidated
into what DDP's checkpoint holds.

Under DDP the embedding has one ``param.grad``: each optimizer steps it with its own state, any
``zero_grad`` clears it, and an optimizer skips it while it is None. Two orders of manual
optimization (Lightning 2.x refuses two optimizers under automatic optimization, so manual is the
only way a LightningModule gives one parameter to two optimizers):

* "alternate": Lightning's GAN recipe, ``toggle_optimizer`` around each phase, ``zero_grad`` before
  each backward. The discriminator's phase gives the embedding a gradient only on even batches (a
  detached condition on odd ones): there its optimizer must skip it (SGD with momentum and weight
  decay would move it on a zero gradient).
* "together": one backward of both losses, both optimizers step on the same gradient, then both
  ``zero_grad``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
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
NOISE, DATA, HIDDEN, CLASSES = 5, 7, 13, 11
ZERO3 = {"stage": 3, "param_persistence_threshold": 10, "prefetch_bucket_size": 200, "reduce_bucket_size": 40}
SPECS = [
    ("zero1", {"stage": 1, "reduce_bucket_size": 40}),
    ("zero2", {"stage": 2, "reduce_bucket_size": 40}),
    ("zero3", ZERO3),
    ("zero2_offload", {"stage": 2, "offload_optimizer": True, "reduce_bucket_size": 40}),
]


class SharedEmbeddingGAN(pl.LightningModule):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.mode = mode
        self.embed = nn.Embedding(CLASSES, NOISE)  # in both optimizers
        self.generator = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DATA))
        self.discriminator = nn.Sequential(nn.Linear(DATA + NOISE, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))
        self.losses: list[tuple[float, float]] = []

    def _d(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.discriminator(torch.cat([x, cond], dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, labels = batch
        opt_g, opt_d = self.optimizers()
        # the noise depends on the step and rank only, identical under DDP and ZeRO
        gen = torch.Generator().manual_seed(1000 * self.global_rank + batch_idx)
        noise = torch.randn(real.shape[0], NOISE, generator=gen)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = F.binary_cross_entropy_with_logits
        if self.mode == "together":
            cond = self.embed(labels)
            fake = self.generator(noise + cond)
            d_loss = bce(self._d(real, cond), ones) + bce(self._d(fake.detach(), cond), zeros)
            g_loss = bce(self._d(fake, cond), ones)
            self.manual_backward(d_loss + g_loss)
            opt_d.step()
            opt_g.step()
            opt_d.zero_grad()
            opt_g.zero_grad()
        else:
            self.toggle_optimizer(opt_d)
            cond = self.embed(labels)
            if batch_idx % 2:
                cond = cond.detach()  # no gradient for the shared embedding in this window: skipped
            fake = self.generator(noise + cond).detach()
            d_loss = bce(self._d(real, cond), ones) + bce(self._d(fake, cond), zeros)
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            self.untoggle_optimizer(opt_d)

            self.toggle_optimizer(opt_g)
            cond = self.embed(labels)
            g_loss = bce(self._d(self.generator(noise + cond), cond), ones)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            self.untoggle_optimizer(opt_g)
        self.losses.append((d_loss.item(), g_loss.item()))

    def configure_optimizers(self):
        opt_g = torch.optim.Adam([*self.generator.parameters(), *self.embed.parameters()], lr=2e-2, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(
            [*self.embed.parameters(), *self.discriminator.parameters()], lr=5e-2, momentum=0.9, weight_decay=0.01
        )
        return opt_g, opt_d


def _data() -> DataLoader:
    gen = torch.Generator().manual_seed(3)
    real = torch.randn(24, DATA, generator=gen) * 0.5 + 1.0
    labels = torch.randint(0, CLASSES, (24,), generator=gen)
    return DataLoader(TensorDataset(real, labels), batch_size=3)  # 4 batches per rank and epoch


def _fit(spec: Any, mode: str, epochs: int, ckpt_path: str | None = None, save: str | None = None) -> tuple:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    pl.seed_everything(7, verbose=False)
    model = SharedEmbeddingGAN(mode)
    strategy = DDPStrategy(find_unused_parameters=True) if spec == "ddp" else ZeroStrategy(**spec)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
    )
    trainer.fit(model, train_dataloaders=_data(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    with trainer.strategy.gathered_parameters() if spec != "ddp" else contextlib.nullcontext():
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model.losses, weights


def _parity_worker(rank: int, mode: str) -> dict:
    return {name: _fit(spec, mode, epochs=2) for name, spec in [("ddp", "ddp"), *SPECS]}


@pytest.mark.parametrize("mode", ["alternate", "together"])
def test_shared_parameter_in_two_optimizers_matches_ddp(mode):
    for res in run_ranks(_parity_worker, mode, timeout=900):
        ref_losses, ref_state = res["ddp"]
        assert len(ref_losses) == 8
        for name, _ in SPECS:
            losses, state = res[name]
            # fp32: the only differences are summation order (reduce-scatter of flat buckets vs DDP's
            # all-reduce; the offloaded step's Adam kernel vs torch's): ~1e-7 relative per step,
            # amplified over 16 steps of two optimizers; 1e-5 is the bound of test_multiple_optimizers.py.
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
            for key, value in ref_state.items():
                assert max_rel(state[key], value) <= 1e-5, (name, key)


def _resume_worker(rank: int, tmp: str) -> dict:
    out: dict[str, Any] = {"ddp_half": _fit("ddp", "alternate", epochs=1, save=f"{tmp}/ddp.ckpt")}
    for name, spec in SPECS:
        full, _ = _fit(spec, "alternate", epochs=2)
        _fit(spec, "alternate", epochs=1, save=f"{tmp}/{name}.ckpt")
        resumed, _ = _fit(spec, "alternate", epochs=2, ckpt_path=f"{tmp}/{name}.ckpt")
        out[name] = (full, resumed)
    return out


def _optimizer_states(checkpoint: dict) -> list[dict[int, dict[str, Any]]]:
    return [saved["state"] for saved in checkpoint["optimizer_states"]]


def test_shared_parameter_checkpoint_resumes_exactly_and_consolidates_as_ddp(tmp_path: Path):
    from lightning_zero.checkpoint.consolidate import to_lightning_checkpoint

    results = run_ranks(_resume_worker, str(tmp_path), timeout=900)
    ddp = torch.load(tmp_path / "ddp.ckpt", weights_only=False)
    for name, _ in SPECS:
        full, resumed = results[0][name]
        # the same arithmetic replayed from restored masters and both optimizers' states: exact
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[4:]), rtol=0, atol=0, msg=name)

        plain = tmp_path / f"{name}.plain.ckpt"
        to_lightning_checkpoint(tmp_path / f"{name}.ckpt", plain)
        mine = torch.load(plain, weights_only=False)
        for key, value in ddp["state_dict"].items():
            assert max_rel(mine["state_dict"][key], value) <= 1e-5, (name, key)  # the parity bound above
        # per optimizer, per parameter position (the embedding is in both, with its own state in each)
        for o_index, (got, want) in enumerate(zip(_optimizer_states(mine), _optimizer_states(ddp), strict=True)):
            assert set(got) == set(want), (name, o_index)
            for position, state in want.items():
                assert set(got[position]) == set(state), (name, o_index, position)
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        assert max_rel(got[position][key], value) <= 1e-5, (name, o_index, position, key)
                    else:
                        assert float(got[position][key]) == float(value), (name, o_index, position, key)
