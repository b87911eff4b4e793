"""The quiet Trainer of the tests and the parity run that most distributed tests build on.

A test Trainer writes nothing and prints nothing: no logger, no checkpoint callback, no progress
bar, no model summary (:data:`QUIET`), unless the test turns one on. :func:`fit` trains a freshly
seeded :class:`~tests.helpers.models.ParityModel` (or a subclass) on 2 CPU ranks with accumulation
and clipping; it runs inside ranks started by :func:`lightning_zero.testing.run_ranks`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from tests.helpers.models import ParityModel, make_loader

#: the Trainer keywords that keep a test run silent and free of files
QUIET: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

#: no validation: neither the sanity check before fit nor a validation loop
NO_VALIDATION: dict[str, Any] = {"num_sanity_val_steps": 0, "limit_val_batches": 0}


def quiet_trainer(**options: Any) -> pl.Trainer:
    """``pl.Trainer(**QUIET, **options)``; ``options`` override :data:`QUIET` (a test that checkpoints
    passes ``enable_checkpointing=True``)."""
    return pl.Trainer(**{**QUIET, **options})


def build_strategy(spec: Any):
    """ "ddp" -> Lightning's DDP (find_unused_parameters for the unused parameter); dict -> ZeroStrategy(**spec)."""
    from lightning.pytorch.strategies import DDPStrategy

    if spec == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    if isinstance(spec, str) or not isinstance(spec, dict):
        return spec  # a registered name or a strategy object
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(**spec)


def fit(
    strategy: Any,
    precision: Any = "32-true",
    max_steps: int = 6,
    accumulate: int = 2,
    clip: float | None = 0.5,
    model_kwargs: dict | None = None,
    devices: int = 2,
    plugins: list | None = None,
    seed: int = 7,
    trainer_kwargs: dict | None = None,
    ckpt_path: str | None = None,
    loader: DataLoader | None = None,
    model_cls: type | None = None,
) -> tuple[pl.Trainer, ParityModel]:
    """Train a freshly seeded ParityModel; returns the trainer and the model."""
    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(seed, workers=True, verbose=False)
    model = (model_cls or ParityModel)(**(model_kwargs or {}))
    options = dict(
        accelerator="cpu",
        devices=devices,
        strategy=build_strategy(strategy),
        precision=precision if plugins is None else None,
        plugins=plugins,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        **NO_VALIDATION,
        deterministic=True,
    )
    options.update(trainer_kwargs or {})
    trainer = quiet_trainer(**options)
    trainer.fit(model, train_dataloaders=loader if loader is not None else make_loader(), ckpt_path=ckpt_path)
    return trainer, model
