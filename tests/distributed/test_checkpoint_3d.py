"""Sharded checkpoints under tensor parallelism on spawned CPU/gloo ranks: exact resume in the same
layout, conversion tp2 x dp2 -> dp2 / tp2 x dp1 / one process / a plain Lightning checkpoint, a
data-parallel-only checkpoint -> tp2, and consolidation to the unsplit model.

The model is a tiny GPT-2 (2 layers, d=32, 2 heads, vocab 64) split by a plan of this file: column-
and row-parallel attention and MLP, the position embedding split by rows ("vocab"); the token
embedding and the tied LM head replicated. One column-parallel MLP is frozen (a split tensor that
ZeRO does not partition) and a buffer changes every step, so both must come back from the files.

Data: every data-parallel rank reads its half of one global batch at every step
(``use_distributed_sampler=False``); one data-parallel rank reads the whole global batch, so its
loss is the mean of the two halves'. Two steps per epoch; the checkpoints are ModelCheckpoint's at
the end of epoch 0.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed

VOCAB, SEQ, HALF, STEPS_PER_EPOCH, STEPS = 64, 16, 2, 2, 4
PLAN = {
    "model.h.*.attn.c_attn": "column",
    "model.h.*.attn.c_proj": "row",
    "model.h.*.mlp.c_fc": "column",
    "model.h.*.mlp.c_proj": "row",
    "model.embed.wpe": "vocab",
}
SPLIT_DIMS = {
    "c_attn.weight": 0,
    "c_attn.bias": 0,
    "c_fc.weight": 0,
    "c_fc.bias": 0,
    "c_proj.weight": 1,
    "wpe.weight": 0,
}
CHECKPOINT = "epoch=0-step=2.ckpt"


def _split_dim(name: str):
    """The partition dim of ``name`` under PLAN (``None``: replicated). Row-parallel biases stay whole."""
    return next((d for suffix, d in SPLIT_DIMS.items() if name.endswith(suffix)), None)


def _module():
    from recipes.gpt2.model import GPT, GPTConfig

    class TinyGPT2(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32))
            self.model.h[1].mlp.c_fc.requires_grad_(False)  # frozen and split: written whole per tp rank
            # Changes every step, equally on every rank (rank 0's buffers are saved, as DDP's are).
            self.register_buffer("seen", torch.zeros(3))
            self.losses: list[float] = []

        def tensor_parallel_plan(self) -> dict[str, str]:
            return PLAN

        def training_step(self, batch, batch_idx):
            (rows,) = batch
            self.seen += torch.tensor([0.5, 1.0, 1.5])
            loss = GPT.loss_fn(self.model(rows[:, :-1]), rows[:, 1:]) + 1e-3 * self.seen.sum()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            params = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    return TinyGPT2()


def _loader(data_parallel: int, dp_rank: int) -> DataLoader:
    """Every batch of a rank is the same (data-parallel rank r: half r of one global batch), so the
    batches replay identically wherever Lightning resumes (it restarts a plain DataLoader's epoch)."""
    rows = torch.randint(0, VOCAB, (2 * HALF, SEQ + 1), generator=torch.Generator().manual_seed(5))
    mine = rows if data_parallel == 1 else rows[dp_rank * HALF : (dp_rank + 1) * HALF]
    return DataLoader(TensorDataset(mine.repeat(STEPS_PER_EPOCH, 1)), batch_size=len(mine))


class _AtCheckpoint(pl.Callback):
    """The parameters and buffer at the end of epoch 0, where ModelCheckpoint saves."""

    def __init__(self) -> None:
        self.params: dict = {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            self.params = _params(pl_module)


def _fit(rank: int, world: int, tp: int, ckpt_path=None, save_dir=None, strategy=None, record=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(3, verbose=False)
    model = _module()
    if strategy is None:
        strategy = lightning_zero.ZeroStrategy(
            stage=2 if tp == 1 else 1, tensor_parallel_size=tp, reduce_bucket_size=999
        )
    callbacks = [ModelCheckpoint(dirpath=save_dir, every_n_epochs=1, save_top_k=-1)] if save_dir else []
    callbacks += [record] if record is not None else []
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=STEPS,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, train_dataloaders=_loader(world // tp, (rank // tp)), ckpt_path=ckpt_path)
    return model


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()} | {"seen": model.seen.clone()}


def _tp2_dp2_worker(rank: int, tmp: str) -> dict:
    record = _AtCheckpoint()
    full = _fit(rank, 4, 2, save_dir=f"{tmp}/a", record=record)
    same = _fit(rank, 4, 2, ckpt_path=f"{tmp}/a/{CHECKPOINT}")
    return {"full": full.losses, "same": same.losses, "at_checkpoint": record.params}


def _two_rank_worker(rank: int, tmp: str) -> dict:
    source = f"{tmp}/a/{CHECKPOINT}"
    dp2 = _fit(rank, 2, 1, ckpt_path=source)  # tp2 x dp2 -> dp2
    tp2 = _fit(rank, 2, 2, ckpt_path=source)  # tp2 x dp2 -> tp2 x dp1 (ZeRO over one rank)
    plain = _fit(rank, 2, 1, save_dir=f"{tmp}/b")  # data parallel only, saved at step 2
    back = _fit(rank, 2, 2, ckpt_path=f"{tmp}/b/{CHECKPOINT}")  # dp2 -> tp2
    return {"dp2": dp2.losses, "tp2": tp2.losses, "plain": plain.losses, "back": back.losses}


def _one_rank_worker(rank: int, tmp: str) -> dict:
    from lightning_zero.checkpoint import to_lightning_checkpoint

    one = _fit(rank, 1, 1, ckpt_path=f"{tmp}/a/{CHECKPOINT}")
    to_lightning_checkpoint(f"{tmp}/a/{CHECKPOINT}", f"{tmp}/plain.ckpt")
    lightning = _fit(rank, 1, 1, ckpt_path=f"{tmp}/plain.ckpt", strategy="auto")  # no ZeRO at all
    return {"one": one.losses, "lightning": lightning.losses}


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0, msg=lambda m: f"{what}: {m}")


def _whole(results: list[dict], key: str) -> dict:
    """The unsplit tensors from the tp2 x dp2 ranks' parts (ranks 0 and 1 form a tensor-parallel group)."""
    out = {}
    for name, part in results[0][key].items():
        dim = _split_dim(name)
        out[name] = part if dim is None else torch.cat([results[0][key][name], results[1][key][name]], dim)
    return out


def test_tensor_parallel_checkpoints_resume_convert_consolidate(tmp_path):
    tmp = str(tmp_path)
    four = run_ranks(_tp2_dp2_worker, tmp, world_size=4, timeout=300)
    # Global loss per step: the mean over the two data-parallel halves (ranks 0 and 2).
    reference = [(a + b) / 2 for a, b in zip(four[0]["full"], four[2]["full"], strict=True)]
    for res in four:
        # Same layout: the same arithmetic on the same data, so the resumed steps are bit-exact.
        assert res["same"] == res["full"][STEPS_PER_EPOCH:]

    source = tmp_path / "a" / CHECKPOINT
    meta = json.loads((source / "metadata.json").read_text())
    assert meta["layout"] == {"data": 2, "tensor": 2, "pipeline": 1} and len(meta["rank_files"]) == 4
    c_fc = meta["params"]["model.h.0.mlp.c_fc.weight"]
    assert (c_fc["shape"], c_fc["partition_dim"], c_fc["tensor_parallel_size"]) == ([128, 32], 0, 2)
    assert {piece[1] for piece in c_fc["pieces"]} == {0, 1}
    wte = meta["params"]["model.embed.wte.weight"]  # replicated: written by tensor-parallel rank 0 only
    assert wte["aliases"] == ["model.head.lm_head.weight"] and {p[0] for p in wte["pieces"]} <= {0, 2}
    frozen = meta["params"]["model.h.1.mlp.c_fc.weight"]  # not partitioned: whole parts from dp rank 0
    assert frozen["optimizer"] is None and [p[:2] for p in frozen["pieces"]] == [[0, 0], [1, 1]]

    # Consolidation (no process group) gives the unsplit model at the checkpoint, exactly.
    from lightning_zero.checkpoint import consolidate
    from lightning_zero.cli import main

    assert main(["consolidate", str(source), str(tmp_path / "whole.pt")]) == 0
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    expected = _whole(four, "at_checkpoint")
    assert set(whole) == set(expected) | {"model.head.lm_head.weight"}
    for name, value in expected.items():
        assert torch.equal(whole[name], value), name
    model = _module()
    model.load_state_dict(whole, strict=True)  # the unconverted LightningModule takes it as it is
    consolidate(source, tmp_path / "bf16.pt", dtype=torch.bfloat16)
    assert torch.equal(
        torch.load(tmp_path / "bf16.pt")["model.h.0.attn.c_attn.weight"],
        expected["model.h.0.attn.c_attn.weight"].bfloat16(),
    )

    two = run_ranks(_two_rank_worker, tmp, world_size=2)
    (one,) = run_ranks(_one_rank_worker, tmp, world_size=1)
    # Another layout sums gradients and row-parallel products in another order: ~1e-7 relative per
    # step in fp32, which 2 AdamW steps keep below 1e-5; a wrong part of a split weight would move
    # the loss by ~1e-2.
    resumed = reference[STEPS_PER_EPOCH:]
    _close([(a + b) / 2 for a, b in zip(two[0]["dp2"], two[1]["dp2"], strict=True)], resumed, "tp2 x dp2 -> dp2")
    _close(two[0]["tp2"], resumed, "tp2 x dp2 -> tp2 x dp1")
    _close(one["one"], resumed, "tp2 x dp2 -> one process")
    _close(one["lightning"], resumed, "tp2 x dp2 -> plain Lightning checkpoint, no ZeRO")
    # The data-parallel run itself follows the tensor-parallel one (same tolerance, same reason),
    # and its checkpoint continues under tp2 as it would have under dp2.
    plain = [(a + b) / 2 for a, b in zip(two[0]["plain"], two[1]["plain"], strict=True)]
    _close(plain, reference, "dp2 vs tp2 x dp2")
    _close(two[0]["back"], plain[STEPS_PER_EPOCH:], "dp2 -> tp2 x dp1")


# -- pipeline stages, simulated: each rank keeps only some layers (as a pipeline stage does) ----------


def _gpt(seed: int, vocab: int = 61):
    from recipes.gpt2.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=SEQ, n_layer=2, n_head=2, n_embd=30))  # odd sizes


def _stage(model, stage: int):
    """Stage 0 keeps embed and h.0, stage 1 h.1 and head; the others become parameter-less
    placeholders. The tied token embedding / LM head weight lives on both, each side naming the other."""
    from torch import nn

    if stage == 0:
        model.h[1], model.head = nn.Identity(), nn.Identity()
        model.embed.wte.weight.tied_names = ("head.lm_head.weight",)
    else:
        model.embed, model.h[0] = nn.Identity(), nn.Identity()
        model.head.lm_head.weight.tied_names = ("embed.wte.weight",)
    return model


def _pipeline_worker(rank: int, tmp: str) -> dict:
    import torch.distributed as dist

    from lightning_zero.checkpoint import load as ckpt_load
    from lightning_zero.checkpoint.save import save_sharded
    from lightning_zero.config import StrategyConfig, ZeroConfig
    from lightning_zero.layout import ParallelLayout
    from lightning_zero.zero.engine import ZeroEngine
    from lightning_zero.zero.surface import ModelParallelContext

    dist.init_process_group("gloo")
    data_parallel = [dist.new_group([0]), dist.new_group([1])][rank]  # one data-parallel rank per stage
    layout = ParallelLayout(1, pipeline=2)

    def engine_for(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return optimizer, ZeroEngine(
            model,
            [optimizer],
            config=StrategyConfig(zero=ZeroConfig(stage=2, reduce_bucket_size=333)),
            precision="32-true",
            device=torch.device("cpu"),
            parallel=ModelParallelContext(data=data_parallel),
        )

    model = _stage(_gpt(0), rank)
    optimizer, engine = engine_for(model)
    save_sharded({"state_dict": {}}, f"{tmp}/stages.ckpt", model, engine, [optimizer], "32-true", layout)

    # The whole model's checkpoint (seed 1, written by the test on one process) into the stages.
    model = _stage(_gpt(2), rank)
    optimizer, engine = engine_for(model)
    checkpoint = ckpt_load.load_checkpoint(f"{tmp}/whole.ckpt", None, rank, torch.load)
    ckpt_load.load_model(checkpoint, model, engine, [optimizer], True, layout)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_pipeline_stages_save_their_layers_and_load_any_layout(tmp_path):
    from lightning_zero.checkpoint import consolidate, read_metadata
    from lightning_zero.checkpoint import load as ckpt_load
    from lightning_zero.checkpoint.save import save_sharded

    whole = _gpt(1)
    save_sharded({"state_dict": {}}, tmp_path / "whole.ckpt", whole, None, [], "32-true")  # one process
    stages = run_ranks(_pipeline_worker, str(tmp_path), world_size=2)

    # Each stage took its own layers from the whole model's checkpoint; the LM head on stage 1
    # resolved through the tied name (the checkpoint holds it under embed.wte.weight), bit-exact.
    reference = dict(whole.named_parameters(remove_duplicate=False))
    for res in stages:
        for name, value in res.items():
            assert torch.equal(value, reference[name]), name
    assert "head.lm_head.weight" in stages[1] and "embed.wte.weight" in stages[0]

    # The stages' checkpoint is the union of their layers, the tied weight stored once (stage 0).
    meta = read_metadata(tmp_path / "stages.ckpt")
    assert meta["layout"] == {"data": 1, "tensor": 1, "pipeline": 2}
    original = _gpt(0)
    assert set(meta["params"]) == {n for n, _ in original.named_parameters()}
    wte = meta["params"]["embed.wte.weight"]
    assert wte["aliases"] == ["head.lm_head.weight"] and {p[0] for p in wte["pieces"]} == {0}
    assert {p[0] for p in meta["params"]["h.1.attn.c_attn.weight"]["pieces"]} == {1}
    consolidate(tmp_path / "stages.ckpt", tmp_path / "stages.pt")
    merged = torch.load(tmp_path / "stages.pt", weights_only=True)
    original.load_state_dict(merged, strict=True)
    for name, value in _gpt(0).state_dict().items():
        assert torch.equal(merged[name], value), name

    # ... and loads into the whole model on one process.
    target = _gpt(2)
    checkpoint = ckpt_load.load_checkpoint(tmp_path / "stages.ckpt", None, 0, torch.load)
    ckpt_load.load_model(checkpoint, target, None, [], True)
    for name, value in _gpt(0).state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


# -- pipeline parallelism, the strategy's own: pp2 -> pp2 (exact) and -> one process ---------------


def _piped_module(pipelined: bool):
    from lightning_zero import PipelineSpec
    from recipes.gpt2.model import GPT

    class PipedGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt(0, VOCAB)
            self.losses: list[float] = []

        def configure_pipeline(self) -> PipelineSpec:
            return PipelineSpec(
                layers=self.model.to_layers(),
                loss=lambda logits, batch: GPT.loss_fn(logits, batch[0][:, 1:]),
                inputs=lambda batch: batch[0][:, :-1],
            )

        def training_step(self, batch, batch_idx):
            assert not pipelined, "replaced by the pipeline schedule"
            loss = GPT.loss_fn(self.model(batch[0][:, :-1]), batch[0][:, 1:])
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return PipedGPT()


def _fit_piped(world: int, pp: int, ckpt_path=None, save_dir=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero import ZeroStrategy

    pl.seed_everything(3, verbose=False)
    model = _piped_module(pp > 1)
    callbacks = [ModelCheckpoint(dirpath=save_dir, every_n_epochs=1, save_top_k=-1)] if save_dir else []
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy=ZeroStrategy(stage=2, pipeline_parallel_size=pp, reduce_bucket_size=333),
        precision="32-true",
        max_steps=STEPS,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, train_dataloaders=_loader(1, 0), ckpt_path=ckpt_path)
    return model.losses


def _pp2_worker(rank: int, tmp: str) -> dict:
    full = _fit_piped(2, 2, save_dir=f"{tmp}/p")
    same = _fit_piped(2, 2, ckpt_path=f"{tmp}/p/{CHECKPOINT}")
    return {"full": full, "same": same}


def _pp_one_rank_worker(rank: int, tmp: str) -> dict:
    return {"one": _fit_piped(1, 1, ckpt_path=f"{tmp}/p/{CHECKPOINT}")}


def test_pipeline_checkpoint_resumes_and_converts(tmp_path):
    from lightning_zero.checkpoint import consolidate, read_metadata

    tmp = str(tmp_path)
    pair = run_ranks(_pp2_worker, tmp, world_size=2)
    full = pair[-1]["full"]  # the last stage computes the loss
    assert pair[-1]["same"] == full[STEPS_PER_EPOCH:]  # same layout, same arithmetic: bit-exact
    meta = read_metadata(tmp_path / "p" / CHECKPOINT)
    assert meta["layout"]["pipeline"] == 2
    assert {f"model.{n}" for n, _ in _gpt(0, VOCAB).named_parameters()} <= set(meta["params"]) | {
        a for e in meta["params"].values() for a in e["aliases"]
    }
    # The pipeline names the tied copies of each other (param.tied_names): stored once, by stage 0.
    wte = meta["params"]["model.embed.wte.weight"]
    assert wte["aliases"] == ["model.head.lm_head.weight"] and {p[0] for p in wte["pieces"]} == {0}
    consolidate(tmp_path / "p" / CHECKPOINT, tmp_path / "p.pt")
    whole = torch.load(tmp_path / "p.pt", weights_only=True)
    _gpt(0, VOCAB).load_state_dict({k.removeprefix("model."): v for k, v in whole.items()}, strict=True)
    (one,) = run_ranks(_pp_one_rank_worker, tmp, world_size=1)
    # One process sums the batch's gradient in one piece instead of per micro-batch and stage: ~1e-7
    # relative, kept below 1e-5 by 2 AdamW steps.
    _close(one["one"], full[STEPS_PER_EPOCH:], "pp2 -> one process")
