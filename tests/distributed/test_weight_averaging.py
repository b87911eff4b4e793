"""Lightning's weight averaging callbacks under ZeRO, against DDP: ``EMAWeightAveraging`` (its
``on_save_checkpoint`` replaces ``checkpoint["state_dict"]`` with the averaged weights and keeps the
current ones in ``current_model_state``; the checkpoint must store what it put there, and a resume
must restore both), ``WeightAveraging`` with torch's EMA ``multi_avg_fn`` swapped in for validation,
``StochasticWeightAveraging``, and a user's ``torch.optim.swa_utils.AveragedModel`` in a callback.

Stage 3 shards the averaged copy like the model (each rank averages its own pieces of the sharded
parameters, :mod:`lightning_zero.zero.averaging`): with every parameter sharded
(``param_persistence_threshold=0``), with the default threshold (all of this tiny model's parameters
stay whole), with offload, in the sharded and the full checkpoint formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.testing import run_ranks
from tests.helpers.models import make_loader, state
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

SPECS = {
    "ddp": "ddp",
    "zero1": {"stage": 1, "reduce_bucket_size": 40},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
}


def _ema():
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return EMAWeightAveraging(decay=0.5)  # a short memory: the average differs from the weights


# stage 3: current_model_state keeps every weight, in the full checkpoint (the module state as
# DDP's) and in the sharded one (filled in on rank 0 because the callback moved it there)
EMA_SPECS = {
    **SPECS,
    "zero3": {"stage": 3, "reduce_bucket_size": 40, "state_dict_type": "full"},
    "zero3_sharded": {"stage": 3, "reduce_bucket_size": 40},
    # every parameter sharded: the averaged copy holds this rank's pieces
    "zero3_all_sharded": {"stage": 3, "reduce_bucket_size": 40, "param_persistence_threshold": 0},
    "zero3_all_sharded_full": {
        "stage": 3,
        "reduce_bucket_size": 40,
        "param_persistence_threshold": 0,
        "state_dict_type": "full",
    },
    "zero3_offload": {
        "stage": 3,
        "param_persistence_threshold": 0,
        "offload_optimizer": True,
        "offload_parameters": True,
    },
}
STAGE3 = [name for name in EMA_SPECS if name.startswith("zero3")]


def _worker(rank: int, tmp: str) -> dict:
    out = {}
    for name, spec in EMA_SPECS.items():
        path = f"{tmp}/{name}.ckpt"
        kwargs = {"callbacks": [_ema()]}
        trainer, _ = fit(spec, max_steps=4, accumulate=1, trainer_kwargs=kwargs)
        trainer.save_checkpoint(path)
        _, resumed = fit(spec, max_steps=7, accumulate=1, trainer_kwargs={"callbacks": [_ema()]}, ckpt_path=path)
        callback = next(c for c in resumed.trainer.callbacks if type(c).__name__ == "EMAWeightAveraging")
        # (at stage 3 the copy's state_dict gathers the pieces: whole tensors, as DDP's)
        average = {k: v.detach().float().clone() for k, v in callback._average_model.module.state_dict().items()}
        # after fit the callback copied the average into the model
        out[name] = {"losses": resumed.losses, "average": average, "final": state(resumed)}
    return out


def _saved_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        out = path.with_suffix(".pt")
        consolidate(path, out)
        return torch.load(out, weights_only=True)
    return torch.load(path, weights_only=True)["state_dict"]


def test_ema_callback_save_and_resume_match_ddp(tmp_path):
    results = run_ranks(_worker, str(tmp_path))
    ref_saved = _saved_weights(tmp_path / "ddp.ckpt")
    for name in ("zero1", "zero2", *STAGE3):
        saved = _saved_weights(tmp_path / f"{name}.ckpt")
        # The averaged weights are what the checkpoint stores (before: the current weights, 9.6e-2
        # relative off). fp32: the same arithmetic up to the reduction order (~1e-7 a step).
        assert saved.keys() == ref_saved.keys()
        for key, value in ref_saved.items():
            torch.testing.assert_close(saved[key].float(), value.float(), rtol=1e-5, atol=1e-7, msg=(name, key))
        for res in results:
            # the resume restores the current weights (losses) and the average (before: a missing-key
            # error; at stage 3 in earlier versions, current_model_state lacked the partitioned parameters)
            torch.testing.assert_close(res[name]["losses"], res["ddp"]["losses"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(res[name]["average"], res["ddp"]["average"], rtol=1e-5, atol=1e-7, msg=name)
            torch.testing.assert_close(res[name]["final"], res["ddp"]["final"], rtol=1e-5, atol=1e-7, msg=name)


SWA_SPECS = {**SPECS, "zero3_all_sharded": EMA_SPECS["zero3_all_sharded"], "zero3_offload": EMA_SPECS["zero3_offload"]}


def _swa_worker(rank: int, tmp: str) -> dict:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def swa() -> StochasticWeightAveraging:
        return StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1)

    out = {}
    for name, spec in SWA_SPECS.items():
        path = f"{tmp}/swa-{name}.ckpt"
        run = {"accumulate": 1, "clip": None, "loader": make_loader(n=24), "max_steps": -1}
        trainer, first = fit(spec, trainer_kwargs={"callbacks": [swa()], "max_epochs": 2}, **run)
        trainer.save_checkpoint(path)  # inside the SWA epochs: the average and SWALR's state are saved
        callback = swa()
        _, model = fit(spec, trainer_kwargs={"callbacks": [callback], "max_epochs": 3}, ckpt_path=path, **run)
        # the callback's state (what a checkpoint stores): the averaged model, whole
        average = {k: v.detach().clone() for k, v in callback.state_dict()["average_model_state"].items()}
        out[name] = {"losses": first.losses + model.losses, "weights": state(model), "average": average}
    return out


def test_stochastic_weight_averaging_matches_ddp(tmp_path):
    """Trained two epochs, saved, resumed for the third (SWA from the second epoch on)."""
    for res in run_ranks(_swa_worker, str(tmp_path)):
        ref = res["ddp"]
        assert len(ref["losses"]) == 12, ref["losses"]  # 3 epochs of 4 batches per rank
        for name in SWA_SPECS:
            # fp32; SWA swaps the LR schedule (SWALR on the optimizer's groups) and copies the
            # average into the parameters at the end of training: the same numbers up to the
            # reduction order (~1e-7 a step).
            torch.testing.assert_close(res[name]["losses"], ref["losses"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(res[name]["weights"], ref["weights"], rtol=1e-5, atol=1e-7, msg=name)
            torch.testing.assert_close(res[name]["average"], ref["average"], rtol=1e-5, atol=1e-7, msg=name)


class _UserAverage:
    """A user's callback: an ``AveragedModel`` made from the model in ``on_fit_start`` (at stage 3 a
    copy of the sharded model), updated after every step."""

    def __new__(cls) -> Any:
        import lightning.pytorch as pl
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        class UserAverage(pl.Callback):
            def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                self.averaged = AveragedModel(pl_module, multi_avg_fn=get_ema_multi_avg_fn(0.7))

            def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
                self.averaged.update_parameters(pl_module)

        return UserAverage()


def _validation_worker(rank: int) -> dict:
    from lightning.pytorch.callbacks import WeightAveraging
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    out = {}
    for name in ("ddp", "zero3_all_sharded", "zero3_offload"):
        ema, user = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.5)), _UserAverage()
        validated: list[float] = []
        kwargs = {"callbacks": [ema, user, _ValLosses(validated)], "limit_val_batches": 2, "val_check_interval": 2}
        _, model = fit(EMA_SPECS[name], max_steps=6, accumulate=1, trainer_kwargs=kwargs, model_cls=_validated())
        user_average = {k: v.detach().clone() for k, v in user.averaged.state_dict().items()}
        out[name] = {"losses": model.losses, "val": validated, "final": state(model), "user": user_average}
    return out


def _validated() -> type:
    from tests.helpers.models import ParityModel

    class Validated(ParityModel):
        def val_dataloader(self) -> Any:
            return make_loader(n=12, seed=99)

    return Validated


class _ValLosses:
    def __new__(cls, into: list[float]) -> Any:
        import lightning.pytorch as pl

        class ValLosses(pl.Callback):
            def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                into.append(float(trainer.callback_metrics["val_loss"]))

        # val_loss was logged by the validation steps, which ran on the swapped-in average
        return ValLosses()


def test_averaged_weights_validate_and_user_averaged_model_match_ddp():
    for res in run_ranks(_validation_worker):
        ref = res["ddp"]
        assert len(ref["val"]) == 3, ref["val"]
        for name in ("zero3_all_sharded", "zero3_offload"):
            # fp32, as above: the training losses (the swap back after validation restored the
            # weights), the validation losses of the swapped-in average, the final weights (the
            # average), and the user's AveragedModel (whole in its state_dict)
            torch.testing.assert_close(res[name]["losses"], ref["losses"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(res[name]["val"], ref["val"], rtol=1e-5, atol=0, msg=name)
            torch.testing.assert_close(res[name]["final"], ref["final"], rtol=1e-5, atol=1e-7, msg=name)
            torch.testing.assert_close(res[name]["user"], ref["user"], rtol=1e-5, atol=1e-7, msg=name)


def _bf16_worker(rank: int, tmp: str) -> None:
    for name, spec in {
        "zero2": {**SPECS["zero2"], "state_dict_type": "full"},
        "zero3": EMA_SPECS["zero3_all_sharded_full"],
    }.items():
        trainer, _ = fit(
            spec, precision="bf16-mixed", max_steps=4, accumulate=1, trainer_kwargs={"callbacks": [_ema()]}
        )
        trainer.save_checkpoint(f"{tmp}/{name}-bf16.ckpt")  # after fit: on_train_end copied the average in


def test_average_copied_at_train_end_reaches_the_masters(tmp_path):
    """Mixed precision: the fp32 masters are separate from the bf16 parameters. The average that the
    callback copies into the model in on_train_end must reach them, or a checkpoint saved after fit
    stores the last trained weights as current_model_state (DDP's: the average, like state_dict)."""
    run_ranks(_bf16_worker, str(tmp_path))
    for name in ("zero2", "zero3"):
        saved = torch.load(tmp_path / f"{name}-bf16.ckpt", weights_only=True)
        for key, average in saved["state_dict"].items():
            current = saved["current_model_state"][key].float()
            # the model holds the average rounded to bf16 (8 significant bits: 2**-8 relative); the
            # last step moved the weights ~1e-2 away from the average (EMA decay 0.5), 10x more
            torch.testing.assert_close(current, average.float(), rtol=2**-8, atol=1e-6, msg=(name, key))
