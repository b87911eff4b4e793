"""The full checkpoint format under ``ModelCheckpoint(save_top_k=...)`` on 2 CPU/gloo ranks writes
what DDP writes: the same files (replaced ones removed), one ``torch.save`` per checkpoint on rank 0
and none on rank 1, and the same model and optimizer states, and a resume from it calls the module's own
``load_state_dict`` as DDP does; at stages 1, 2 and 3, fp32; also into storage that the
ranks do not share (fsspec's per-process ``memory://``), as DDP's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.models import ParityModel
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

SPECS = {
    "ddp": "ddp",
    "zero1": {"stage": 1, "reduce_bucket_size": 40, "state_dict_type": "full"},
    "zero2": {"stage": 2, "reduce_bucket_size": 40, "state_dict_type": "full"},
    "zero3": {"stage": 3, "param_persistence_threshold": 10, "reduce_bucket_size": 40, "state_dict_type": "full"},
}


class RecordsLoads(ParityModel):
    """Records how Lightning's resume calls the module's own ``load_state_dict``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loads: list[tuple[int, bool]] = []

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.loads.append((len(state_dict), strict))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def _worker(rank: int, tmp: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    out: dict[str, Any] = {}
    for name, spec in SPECS.items():
        folder = Path(tmp) / name
        # monitor "step", mode max: every step's checkpoint is the best so far; from the third on,
        # each save removes the oldest of the top 2 (Lightning's save-then-remove path)
        top_k = ModelCheckpoint(dirpath=folder, monitor="step", mode="max", save_top_k=2, every_n_train_steps=1)
        with mock.patch("torch.save", wraps=torch.save) as counted:
            trainer, _ = fit(
                spec,
                max_steps=4,
                accumulate=1,
                trainer_kwargs={"callbacks": [top_k], "enable_checkpointing": True},
            )
            saves = counted.call_count
        trainer.strategy.barrier()  # rank 0's last file is complete before rank 1 lists the folder
        files = sorted(os.listdir(folder))
        loaded = torch.load(folder / files[0], weights_only=False, map_location="cpu") if rank == 0 else None
        # resume from the newest file (step 4) for two more steps, through an overridden load_state_dict
        resume = str(folder / files[-1])
        _, resumed = fit(spec, max_steps=6, accumulate=1, model_cls=RecordsLoads, ckpt_path=resume)
        out[name] = {
            "saves": saves,
            "files": files,
            "ckpt": loaded,
            "loads": resumed.loads,
            "resumed_losses": resumed.losses,
        }
        trainer.strategy.barrier()  # no rank starts the next fit (another folder) while one still reads
    for name in ("ddp", "zero3"):
        # fsspec's memory:// is one store per process: storage no two ranks share, which a full
        # checkpoint (written by rank 0 alone) does not need, as under DDP
        import fsspec

        url = f"memory://full-{name}"
        every = ModelCheckpoint(dirpath=url, save_top_k=-1, every_n_train_steps=2)
        fit(SPECS[name], max_steps=2, accumulate=1, trainer_kwargs={"callbacks": [every], "enable_checkpointing": True})
        if rank == 0:
            with fsspec.open(f"{url}/epoch=0-step=2.ckpt", "rb") as f:
                out[f"{name}-memory"] = torch.load(f, weights_only=False)["global_step"]
    return out


def _states(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's tensors and every optimizer state tensor, by a readable key."""
    flat = {f"model/{k}": v.float() for k, v in ckpt["state_dict"].items()}
    for o, saved in enumerate(ckpt["optimizer_states"]):
        for index, entry in saved["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value):
                    flat[f"optim{o}/{index}/{key}"] = value.float()
    return flat


def test_full_format_save_top_k_matches_ddp(tmp_path: Path) -> None:
    res = run_ranks(_worker, str(tmp_path))
    assert res[0]["ddp-memory"] == res[0]["zero3-memory"] == 2
    ref = res[0]["ddp"]
    assert ref["files"] == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt"], ref["files"]
    for name in SPECS:
        for rank in (0, 1):
            got = res[rank][name]
            assert got["files"] == ref["files"], (name, rank, got["files"])
            # DDP: one torch.save per written checkpoint (4), on rank 0 only
            assert got["saves"] == (4 if rank == 0 else 0), (name, rank, got["saves"])
        # DDP: the whole state dict, strict as Lightning asks (LightningModule.strict_loading None)
        assert res[0][name]["loads"] == ref["loads"] == [(len(ref["ckpt"]["state_dict"]), True)], name
        for rank in (0, 1):
            # the two steps after the resume, from the same weights and moments: 1e-5 relative as above
            got, expected_losses = res[rank][name]["resumed_losses"], res[rank]["ddp"]["resumed_losses"]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        got_ckpt = res[0][name]["ckpt"]
        assert got_ckpt["global_step"] == ref["ckpt"]["global_step"]
        expected, actual = _states(ref["ckpt"]), _states(got_ckpt)
        assert expected.keys() <= actual.keys(), (name, sorted(expected.keys() - actual.keys()))
        for key in actual.keys() - expected.keys():
            # ParityModel.unused never has a gradient: DDP's AdamW keeps no state for it, ZeRO's
            # consolidated state has its untouched (zero) moments
            assert key.endswith("/step") or not actual[key].any(), (name, key)
        for key, value in expected.items():
            # one fp32 optimizer step on the same averaged gradients: the reduction order of the
            # gradient average differs (bucketed reduce-scatter vs DDP's all-reduce), a few ulps
            # of fp32 amplified by Adam's division by sqrt(v); 1e-5 relative as in test_parity
            torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-7, msg=f"{name} {key}")
