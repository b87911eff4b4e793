"""Resuming ``StochasticWeightAveraging`` with the user's own ``LambdaLR`` under ZeRO stages 1/2, against
DDP (fp32, 2 CPU/gloo ranks). Lightning's SWA drops the user's scheduler in ``on_fit_start`` when its
restored state holds an ``SWALR``; under ZeRO the callback state is restored after ``on_fit_start``
(``restore_checkpoint_after_setup``), so the checkpoint's ``SWALR`` state used to load into the
``LambdaLR``: ``KeyError: 'lr_lambdas'``. (Stage 3 is left out as in test_weight_averaging.py: SWA
averages ``pl_module.parameters()`` outside a forward.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.models import ParityModel, make_loader
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

SPECS = {
    "ddp": "ddp",
    "zero1": {"stage": 1, "reduce_bucket_size": 40},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
}


def _half(step: int) -> float:
    return 0.5


class LambdaModel(ParityModel):
    def configure_optimizers(self):
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, _half)}


def _run(spec: object, directory: Path, max_epochs: int, ckpt_path: str | None = None) -> ParityModel:
    from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging

    callbacks = [
        StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1),
        ModelCheckpoint(dirpath=directory, monitor=None, save_top_k=-1),
    ]
    kwargs = {"callbacks": callbacks, "max_epochs": max_epochs, "enable_checkpointing": True}
    _, model = fit(
        spec,
        max_steps=-1,
        accumulate=1,
        clip=None,
        trainer_kwargs=kwargs,
        loader=make_loader(n=24),
        model_cls=LambdaModel,
        ckpt_path=ckpt_path,
    )
    return model


def _worker(rank: int, tmp: str) -> dict:
    out = {}
    for name, spec in SPECS.items():
        directory = Path(tmp) / name
        _run(spec, directory, 2)  # SWA starts averaging in epoch 1: its SWALR state is in epoch 1's checkpoint
        resumed = _run(spec, directory, 3, ckpt_path=str(directory / "epoch=1-step=8.ckpt"))
        out[name] = {
            "losses": resumed.losses,
            "weights": {k: v.detach().clone() for k, v in resumed.state_dict().items()},
        }
    return out


def test_swa_resume_with_lambda_lr_matches_ddp(tmp_path):
    for res in run_ranks(_worker, str(tmp_path)):
        ref = res["ddp"]
        for name in ("zero1", "zero2"):
            # fp32: the same numbers up to the reduction order (~1e-7 a step)
            torch.testing.assert_close(res[name]["losses"], ref["losses"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(res[name]["weights"], ref["weights"], rtol=1e-5, atol=1e-7, msg=name)
