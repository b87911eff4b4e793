"""Fabric checkpoints with ZeRO on 2 gloo ranks: ``fabric.save`` / ``fabric.load`` round trip
(into another stage), and interchange with the Trainer strategy in both directions and with a plain
Fabric DDP checkpoint. Every resumed run must continue as the uninterrupted Fabric run does.

Every batch of a rank is the same row (``_loader``), so the batches a resumed run sees do not depend on
where a loop restarts its epoch (the Trainer's loop counters are not in a Fabric checkpoint).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks
from tests.helpers.fabric import make_fabric, train, weights
from tests.helpers.models import ParityModel, make_loader
from tests.helpers.parity import max_rel
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

ZERO2 = {"stage": 2, "reduce_bucket_size": 40}
ZERO3 = {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0}


def _loader(rank: int) -> DataLoader:
    row = make_loader(n=1, seed=1000 + rank).dataset.tensors[0][0]
    return DataLoader(TensorDataset(row.repeat(24, 1)), batch_size=3)


def _setup(spec: Any, rank: int, seed: int = 7) -> tuple[Any, ...]:
    import lightning.pytorch as pl

    fabric = make_fabric(spec)
    pl.seed_everything(seed, verbose=False)
    model = ParityModel()
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(_loader(rank), use_distributed_sampler=False)
    return fabric, model, fabric_model, fabric_optimizer, scheduler, loader


def _continue(spec: Any, rank: int, path: str) -> dict[str, Any]:
    """A differently seeded model of ``spec`` loads ``path`` and trains 2 steps."""
    fabric, model, fabric_model, optimizer, scheduler, loader = _setup(spec, rank, seed=8)
    state = {"model": fabric_model, "optimizer": optimizer, "scheduler": scheduler, "step": -1}
    remainder = fabric.load(path, state, strict=False)
    losses = train(fabric, fabric_model, optimizer, scheduler, loader, "norm", 2)
    out = {"losses": losses, "state": weights(fabric, model), "step": state["step"], "remainder": sorted(remainder)}
    fabric.strategy.teardown()
    return out


def _worker(rank: int, tmp: str) -> dict:
    import lightning_zero  # noqa: F401 - registers the names

    out: dict[str, Any] = {}
    # the uninterrupted Fabric run, saved after 2 of its 4 steps
    fabric, model, fabric_model, optimizer, scheduler, loader = _setup(ZERO2, rank)
    first = train(fabric, fabric_model, optimizer, scheduler, loader, "norm", 2)
    fabric.save(f"{tmp}/fabric", {"model": fabric_model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    out["full"] = {"first": first, "losses": train(fabric, fabric_model, optimizer, scheduler, loader, "norm", 2)}
    out["full"]["state"] = weights(fabric, model)
    fabric.strategy.teardown()
    # Fabric -> Fabric at another stage
    out["fabric_stage3"] = _continue(ZERO3, rank, f"{tmp}/fabric")
    # Fabric -> Trainer (ckpt_path=): the Trainer strategy reads the same directory
    fit_options = dict(max_steps=2, accumulate=2, clip=0.5, loader=_loader(rank))
    fit_options["trainer_kwargs"] = {"use_distributed_sampler": False}
    _, resumed = fit(ZERO2, ckpt_path=f"{tmp}/fabric", seed=8, **fit_options)
    out["trainer_from_fabric"] = {"losses": resumed.losses, "state": _trainer_weights(resumed)}
    # Trainer -> Fabric: a Trainer checkpoint after 2 steps, continued by Fabric at stage 1
    trainer, trained = fit(ZERO2, **fit_options)
    trainer.save_checkpoint(f"{tmp}/trainer")
    out["trainer_first"] = trained.losses
    out["fabric_from_trainer"] = _continue({"stage": 1, "reduce_bucket_size": 40}, rank, f"{tmp}/trainer")
    # a plain Fabric DDP checkpoint (one file) -> ZeRO
    fabric, model, fabric_model, optimizer, scheduler, loader = _setup("ddp", rank)
    train(fabric, fabric_model, optimizer, scheduler, loader, "norm", 2)
    fabric.save(f"{tmp}/ddp.ckpt", {"model": fabric_model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    out["fabric_from_ddp"] = _continue(ZERO2, rank, f"{tmp}/ddp.ckpt")
    return out


def _trainer_weights(model: ParityModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def test_fabric_checkpoints_round_trip_and_interchange_with_trainer(tmp_path):
    for res in run_ranks(_worker, str(tmp_path), timeout=600):
        full = res["full"]
        # fp32: the resumed runs differ from the uninterrupted one only in summation order (another
        # stage, the Trainer's or DDP's reductions): ~1e-7 relative per step; 1e-5 as in the parity tests.
        torch.testing.assert_close(torch.tensor(res["trainer_first"]), torch.tensor(full["first"]), rtol=1e-5, atol=0)
        for name in ("fabric_stage3", "trainer_from_fabric", "fabric_from_trainer", "fabric_from_ddp"):
            got = res[name]
            assert len(got["losses"]) == len(full["losses"]) == 4, name
            torch.testing.assert_close(
                torch.tensor(got["losses"]), torch.tensor(full["losses"]), rtol=1e-5, atol=0, msg=name
            )
            for key, value in full["state"].items():
                assert max_rel(got["state"][key], value) <= 1e-5, (name, key)
        # what fabric.load gives back besides the objects it restored in place
        assert res["fabric_stage3"]["step"] == 2 and res["fabric_from_ddp"]["step"] == 2
        assert "global_step" in res["fabric_from_trainer"]["remainder"]  # the Trainer's counters come back
        # the loss moved: a resumed run that restarted from scratch would not match
        assert abs(full["losses"][0] - full["first"][0]) > 1e-3
