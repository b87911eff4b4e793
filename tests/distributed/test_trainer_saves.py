"""Model-only saves through the Trainer at every stage, against Lightning's DDP on 2 gloo ranks.

``trainer.save_checkpoint(path, weights_only=True)`` (what ``ModelCheckpoint(save_weights_only=True)``
calls) after a short fit, then a fresh model of another seed validated from it with
``trainer.validate(ckpt_path=path)`` (the Trainer's model-only load: validation restores the model
alone). The sharded directory and the full file must hold the model and no optimizer state, the
weights equal to DDP's, and the validation loss equal to DDP's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.models import ParityModel, make_loader, state
from tests.helpers.trainer import build_strategy, fit

pytestmark = pytest.mark.distributed

ZERO3 = {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0}
SPECS = [
    ("ddp", "ddp"),
    ("zero1", {"stage": 1}),
    ("zero2_full", {"stage": 2, "reduce_bucket_size": 40, "state_dict_type": "full"}),
    ("zero3", ZERO3),
    ("zero3_full", {**ZERO3, "state_dict_type": "full"}),
]
# fp32 on CPU: ZeRO reduces the same gradients in another grouping and steps slices, so sums round
# differently (~1e-7 relative per step, 3 steps); 1e-5 relative on the loss and 1e-4 on weights keep
# two orders of margin and still catch a missed or wrong piece (~1e-1).
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4


def _worker(rank: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    out = {}
    for name, spec in SPECS:
        trainer, model = fit(spec, max_steps=3)
        path = f"{tmp}/{name}.ckpt"
        trainer.save_checkpoint(path, weights_only=True)
        trained = state(model)  # stage 3: whole again after fit
        pl.seed_everything(8, verbose=False)
        fresh = ParityModel()
        validator = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=build_strategy(spec),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        metrics = validator.validate(fresh, dataloaders=make_loader(n=12), ckpt_path=path, verbose=False)
        out[name] = {"state": trained, "val_loss": metrics[0]["val_loss"]}
    return out


@pytest.mark.timeout(900)
def test_trainer_weights_only_saves_match_ddp(tmp_path) -> None:
    import lightning_zero.checkpoint as ckpt

    results = run_ranks(_worker, str(tmp_path), timeout=900)
    for rank_out in results:
        ddp = rank_out["ddp"]
        for name, _ in SPECS[1:]:
            ours = rank_out[name]
            assert ours["val_loss"] == pytest.approx(ddp["val_loss"], rel=LOSS_RTOL, abs=0), name
            for key, value in ddp["state"].items():
                torch.testing.assert_close(ours["state"][key], value, rtol=0, atol=WEIGHT_ATOL, msg=f"{name}: {key}")
    ddp_file = torch.load(tmp_path / "ddp.ckpt", weights_only=False)
    assert "optimizer_states" not in ddp_file
    for name, spec in SPECS[1:]:
        path = tmp_path / f"{name}.ckpt"
        if spec.get("state_dict_type") == "full":
            assert path.is_file(), name
            saved = torch.load(path, weights_only=False)
            assert "optimizer_states" not in saved, name
            weights = saved["state_dict"]
        else:
            assert path.is_dir(), name
            ckpt.consolidate(path, tmp_path / f"{name}.pt")
            weights = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert weights.keys() == ddp_file["state_dict"].keys(), name
        for key, value in ddp_file["state_dict"].items():
            torch.testing.assert_close(weights[key].float(), value.float(), rtol=0, atol=WEIGHT_ATOL, msg=name)
