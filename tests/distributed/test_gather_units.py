"""Stage 3 on models that read parameters across module boundaries (gather units, the root unit,
gathering on use in a step, metadata of released parameters, a rank-dependent branch), on 2 CPU/gloo
ranks against DDP. One spawn per concern, several models each."""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import unit_models as um
from models import ParityModel, fit

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed

HAS_PEFT = importlib.util.find_spec("peft") is not None
MODELS = ["CrossReads", "HFSeq2Seq"] + (["LoraLlama"] if HAS_PEFT else [])
SPECS = {
    "zero3": {"stage": 3},
    "zero3_t0": {"stage": 3, "param_persistence_threshold": 0},
    "zero3_offload": {"stage": 3, "offload_optimizer": True},
    "zero3_offload_t0": {"stage": 3, "offload_optimizer": True, "param_persistence_threshold": 0},
}


def _run(spec: Any, name: str, **kwargs: Any) -> tuple[pl.Trainer, pl.LightningModule]:
    return fit(spec, model_cls=getattr(um, name), loader=um.loader(), max_steps=3, clip=None, **kwargs)


def _parity_worker(rank: int) -> dict:
    out: dict = {}
    for name in MODELS:
        out[name, "ddp"] = _run("ddp", name)[1].losses
        for key, spec in SPECS.items():
            out[name, key] = _run(spec, name)[1].losses
    return out


def test_cross_module_reads_match_ddp():
    """A tied head and a sibling's weight used functionally, nn.TransformerEncoderLayer, a parameter of
    the LightningModule read in training_step, an L2 penalty over self.parameters(); HF T5; PEFT LoRA
    on Llama: each trains at stage 3 (offloaded too, every parameter sharded too) with DDP's losses."""
    for res in run_ranks(_parity_worker, timeout=900):
        for name in MODELS:
            ref = torch.tensor(res[name, "ddp"])
            assert len(ref) == 6
            for key in SPECS:
                # fp32 on both sides; the sums over ranks and over flat buffers are ordered differently
                # from DDP's buckets, so a few ulps of a float32 loss (~1e-7 relative per step) build
                # up over six steps; 1e-5 relative is the bound the issue sets and far below any
                # real difference (a wrong or stale parameter changes the first loss in the 3rd digit).
                torch.testing.assert_close(torch.tensor(res[name, key]), ref, rtol=1e-5, atol=0, msg=f"{name} {key}")


def _checkpoint_worker(rank: int, tmp: str) -> dict:
    from lightning_zero.checkpoint import consolidate

    out: dict = {}
    for name in ["CrossReads", "HFSeq2Seq"]:
        spec = SPECS["zero3_t0"]
        trainer, _ = fit(spec, model_cls=getattr(um, name), loader=um.loader(), max_steps=2, clip=None)
        path = f"{tmp}/{name}.ckpt"
        trainer.save_checkpoint(path)
        _, resumed = fit(spec, model_cls=getattr(um, name), loader=um.loader(), max_steps=4, clip=None, ckpt_path=path)
        trainer, straight = fit(spec, model_cls=getattr(um, name), loader=um.loader(), max_steps=4, clip=None)
        trainer.save_checkpoint(f"{tmp}/{name}_final.ckpt")
        _, ddp = fit("ddp", model_cls=getattr(um, name), loader=um.loader(), max_steps=4, clip=None)
        if rank == 0:
            consolidate(f"{tmp}/{name}_final.ckpt", f"{tmp}/{name}.pt")
            merged = torch.load(f"{tmp}/{name}.pt", weights_only=True)
            out[name] = {
                "resumed": resumed.losses,
                "straight": straight.losses[-len(resumed.losses) :],
                "merged": {k: v.float() for k, v in merged.get("state_dict", merged).items()},
                "ddp": {k: v.detach().float().clone() for k, v in ddp.state_dict().items()},
            }
    return out


def test_cross_module_reads_save_resume_consolidate(tmp_path):
    res = run_ranks(_checkpoint_worker, str(tmp_path), timeout=900)[0]
    for name, got in res.items():
        # A resumed run repeats the uninterrupted one step for step (same shards, same states).
        torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["straight"]), rtol=1e-6, atol=0)
        assert got["merged"].keys() >= got["ddp"].keys() - {"model.lm_head.weight"}, name
        for key, value in got["ddp"].items():
            if key in got["merged"]:
                # fp32; four AdamW steps at lr 1e-3 from DDP's gradients summed in another order
                torch.testing.assert_close(got["merged"][key], value, rtol=1e-4, atol=1e-6, msg=f"{name} {key}")


class _Reader(pl.Callback):
    """Between steps: metadata of a released parameter is the full parameter's; its values raise."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        weight = pl_module.side.weight
        self.meta = (
            tuple(weight.shape),
            tuple(weight.size()),
            weight.size(0),
            weight.ndim,
            weight.dim(),
            weight.numel(),
            weight.dtype,
            weight.device,
            weight.requires_grad,
            weight.is_floating_point(),
        )
        try:
            weight.sum()
            self.error = None
        except RuntimeError as error:
            self.error = str(error)
        with trainer.strategy.gathered_parameters(pl_module.side):
            self.inside = pl_module.side.weight.detach().clone()


class _Branch(ParityModel):
    """Rank 0 alone runs ``extra``: a rank-dependent branch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = torch.nn.Linear(15, 15)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(tokens))
        if self.global_rank == 0:
            x = self.extra(x)
        x = x + self.down(torch.tanh(self.up(x)))
        return self.head(self.norm(x))


def _errors_worker(rank: int) -> dict:
    reader = _Reader()
    fit(
        SPECS["zero3_t0"],
        model_cls=um.CrossReads,
        loader=um.loader(),
        max_steps=1,
        accumulate=1,
        clip=None,
        trainer_kwargs={"callbacks": [reader]},
    )
    out: dict = {"meta": reader.meta, "error": reader.error, "inside": reader.inside.shape}
    try:
        fit({"stage": 3, "param_persistence_threshold": 0}, model_cls=_Branch, max_steps=2)
        out["branch"] = None
    except RuntimeError as error:
        out["branch"] = str(error)
    return out


def test_metadata_anywhere_values_in_steps_and_branch_error():
    for res in run_ranks(_errors_worker, timeout=600):
        width = 331
        assert res["meta"] == (
            (width, width),
            (width, width),
            width,
            2,
            2,
            width * width,
            torch.float32,
            torch.device("cpu"),
            True,
            True,
        )
        assert res["error"] is not None and "'side.weight'" in res["error"] and "gathered_parameters" in res["error"]
        assert res["inside"] == (width, width)
        # rank 0 gathers 'extra', rank 1 'up': an error naming both on every rank, not a gloo abort
        assert res["branch"] is not None and "'extra.weight'" in res["branch"] and "'up.weight'" in res["branch"]
