"""The model-parallel runs that the tensor-parallel, pipeline and activation-checkpointing tests share:
the recipes' tiny GPT-2 split by its tensor-parallel plan (:func:`fit_tensor_parallel`) or into
pipeline stages (:func:`fit_pipelined`), trained on the rows of :mod:`tests.helpers.gpt_reference`
so that the one-process reference run sees the same batches."""

from __future__ import annotations

import torch

from tests.helpers.gpt_reference import BATCH, CLIP, LR, SEED, STEPS, tiny_gpt, tokens
from tests.helpers.trainer import quiet_trainer

EPS = 1e-6  # AdamW's eps in the pipeline runs: see tests/distributed/test_pipeline.py's docstring


def piped_gpt():
    """The 3-block tiny GPT-2 as a LightningModule with a pipeline spec and a tensor-parallel plan."""
    import lightning.pytorch as pl

    from lightning_zero import PipelineSpec
    from recipes.gpt2.model import TENSOR_PARALLEL_PLAN

    class PipedGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt(n_layer=3)
            self.losses: list[float] = []
            self.norms: list[float] = []

        def configure_pipeline(self) -> PipelineSpec:
            return PipelineSpec(
                layers=self.model.to_layers(),
                loss=lambda logits, batch: self.model.loss(logits, batch[0][:, 1:]),
                inputs=lambda batch: batch[0][:, :-1],
            )

        def tensor_parallel_plan(self) -> dict[str, str]:
            return {f"model.{k}": v for k, v in TENSOR_PARALLEL_PLAN.items()}

        def forward(self, input_ids):  # Lightning's predict requires it (refused under pipelining)
            return self.model(input_ids)

        # Lightning runs a loop only when the hook exists; under pipelining the schedule runs instead.
        def training_step(self, batch, batch_idx):  # pragma: no cover
            raise AssertionError("training_step is replaced by the pipeline schedule")

        def validation_step(self, batch, batch_idx):  # pragma: no cover
            raise AssertionError("validation_step is replaced by the pipeline schedule")

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

        def on_before_optimizer_step(self, optimizer) -> None:
            self.norms.append(float(self.trainer.strategy.grad_norm(optimizer)))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, eps=EPS)

    return PipedGPT()


def fit_pipelined(
    world: int,
    tensor: int,
    pipeline: int,
    stage: int,
    micro_batches: int,
    schedule: str,
    accumulate: int = 1,
    chunks: int = 1,
    sequence_parallel: bool = False,
    **options,
) -> dict:
    """``options``: further ZeroStrategy arguments (e.g. activation_checkpointing)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from lightning_zero.parallel.pipeline import RemoteLayer

    pl.seed_everything(SEED, verbose=False)
    model = piped_gpt()
    strategy = ZeroStrategy(
        stage=stage,
        tensor_parallel_size=tensor,
        pipeline_parallel_size=pipeline,
        pipeline_micro_batches=micro_batches,
        pipeline_schedule=schedule,
        pipeline_chunks=chunks,
        reduce_bucket_size=3000,
        sequence_parallel=sequence_parallel,
        **options,
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
    )
    data = world // (tensor * pipeline)
    loader = DataLoader(TensorDataset(tokens(BATCH * STEPS * data)), batch_size=BATCH // accumulate, shuffle=False)
    trainer.fit(model, train_dataloaders=loader)
    val = trainer.validate(model, DataLoader(TensorDataset(tokens(BATCH)), batch_size=BATCH), verbose=False)
    runner = strategy._parallel.runner
    try:  # refused at setup, before any batch: the outputs would live on the last stage only
        trainer.predict(model, DataLoader(TensorDataset(tokens(BATCH)), batch_size=BATCH))
        predict_error = None
    except NotImplementedError as error:
        predict_error = str(error)
    return {
        "predict_error": predict_error,
        "losses": model.losses,
        "norms": model.norms,
        "val_loss": val[0]["val_loss"],
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "marked": sorted(n for n, p in model.named_parameters() if getattr(p, "tensor_parallel", False)),
        "remote": sorted(n for n, m in model.named_modules() if isinstance(m, RemoteLayer)),
        "schedule": [repr(a) for a in runner.train_actions] if runner is not None else [],
        "sampler": strategy.distributed_sampler_kwargs,
    }


def gpt_optimizer(name: str, params):
    """``"lamb"``: CPULamb; otherwise torch's AdamW; both with weight decay 0.1."""
    from lightning_zero.ops import CPULamb

    if name == "lamb":
        return CPULamb(params, lr=LR, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


class TinyGPT2:
    """The 2-block tiny GPT-2 as a LightningModule with a tensor-parallel plan; built lazily inside a
    rank (Lightning is imported there)."""

    @staticmethod
    def make(optimizer: str):
        import lightning.pytorch as pl

        from recipes.gpt2.model import TENSOR_PARALLEL_PLAN

        class TinyGPT2(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = tiny_gpt(n_layer=2)
                self.losses: list[float] = []
                self.norms: list[float] = []

            def tensor_parallel_plan(self) -> dict[str, str]:
                return {f"model.{k}": v for k, v in TENSOR_PARALLEL_PLAN.items()}

            def training_step(self, batch, batch_idx):
                (rows,) = batch
                loss = self.model.loss(self.model(rows[:, :-1]), rows[:, 1:])
                self.losses.append(loss.item())
                return loss

            def on_before_optimizer_step(self, optimizer) -> None:
                self.norms.append(float(self.trainer.strategy.grad_norm(optimizer)))

            def configure_optimizers(self):
                return gpt_optimizer(optimizer, self.parameters())

        return TinyGPT2()


def fit_tensor_parallel(
    tensor_parallel: int,
    data_parallel: int,
    stage: int,
    optimizer: str = "adamw",
    sequence_parallel: bool = False,
    **options,
) -> dict:
    """``options``: further ZeroStrategy arguments (e.g. activation_checkpointing)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    pl.seed_everything(SEED, verbose=False)  # the sampler's shuffling seed
    model = TinyGPT2.make(optimizer)
    strategy = ZeroStrategy(
        stage=stage,
        tensor_parallel_size=tensor_parallel,
        reduce_bucket_size=3000,
        sequence_parallel=sequence_parallel,
        **options,
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=tensor_parallel * data_parallel,
        strategy=strategy,
        precision="32-true",
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    loader = DataLoader(TensorDataset(tokens(BATCH * STEPS * data_parallel)), batch_size=BATCH, shuffle=False)
    trainer.fit(model, train_dataloaders=loader)
    return {
        "losses": model.losses,
        "norms": model.norms,
        "sampler": strategy.distributed_sampler_kwargs,
        "params": {n: p.detach().clone() for n, p in model.model.named_parameters()},
        "marked": sorted(n for n, p in model.model.named_parameters() if getattr(p, "tensor_parallel", False)),
    }
