"""A DeepSpeed config against the same run spelled with keyword options, at stages 1, 2 and 3 on 2 CPU ranks.

The config carries ZeRO sizes, gradient accumulation, clipping, an AdamW optimizer and a WarmupDecayLR
schedule for a module without configure_optimizers; the explicit run passes the same options, Trainer
settings and torch objects by hand. Both must train bit-identically: the translation adds nothing.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.models import ParityModel, state
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

OPTIMIZER = {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 3}}


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 12,
        "gradient_clipping": 0.5,
        "optimizer": OPTIMIZER,
        "scheduler": SCHEDULER,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40,
            "overlap_comm": False,
            "stage3_param_persistence_threshold": 10,
            "stage3_prefetch_bucket_size": 200,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10,
    }


class ConfigModel(ParityModel):
    """No configure_optimizers of its own: the config's sections build the optimizer and the schedule."""

    configure_optimizers = pl.LightningModule.configure_optimizers


class ExplicitModel(ParityModel):
    def configure_optimizers(self):
        from lightning_zero.deepspeed_optim import DeepSpeedSchedule

        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        sched = DeepSpeedSchedule(opt, "warmupdecaylr", {**SCHEDULER["params"], "total_num_steps": 6})
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _worker(rank: int) -> dict:
    from lightning_zero import ZeroStrategy

    out = {}
    for stage in (1, 2, 3):
        explicit = {"stage": stage, "reduce_bucket_size": 40, "overlap_comm": False}
        if stage == 3:
            explicit |= {"param_persistence_threshold": 10, "prefetch_bucket_size": 200}
        runs = {
            "config": (ZeroStrategy(config=_config(stage)), ConfigModel, None),
            "explicit": (ZeroStrategy(**explicit), ExplicitModel, 0.5),
        }
        for name, (strategy, cls, clip) in runs.items():
            trainer, model = fit(strategy, max_steps=6, accumulate=2, clip=clip, model_cls=cls)
            lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
            out[(stage, name)] = {
                "losses": model.losses,
                "state": state(model),
                "lr": lrs,
                "steps": trainer.global_step,
            }
    return out


def test_config_trains_as_explicit_options():
    for res in run_ranks(_worker, timeout=600):
        for stage in (1, 2, 3):
            got, ref = res[(stage, "config")], res[(stage, "explicit")]
            assert got["steps"] == ref["steps"] == 6
            # Bitwise: the same optimizer, schedule, clipping and buckets; any difference is a translation bug.
            assert got["losses"] == ref["losses"], stage
            assert got["lr"] == ref["lr"], stage
            for key, value in ref["state"].items():
                assert torch.equal(got["state"][key], value), (stage, key)
