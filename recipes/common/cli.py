"""The LightningCLI of the recipes, and the throughput callback the configs name.

``train.py`` of each recipe is ``RecipeCLI(Module, DataModule)``. The CLI imports ``lightning_zero`` so
that its strategy names (``zero1``, ``zero2``, ...) are registered before the trainer is built, and
checks the model against the data (sequence length vs context) before any tokenizing or training.

``trainer.precision: auto`` (the CPU configs' choice) is resolved by :class:`RecipeTrainer` before
Lightning sees it: "bf16-mixed" where the device multiplies bf16 natively (CPUs with AVX512_BF16 or
AMX, GPUs from Ampere on), else "32-true" (see :mod:`lightning_zero.hardware`).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.cli import LightningCLI

from lightning_zero.hardware import resolve_precision
from recipes.common.data import batch_size, batch_tokens


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's stock ThroughputMonitor fed recipe batches: samples/s, tokens/s (``items_per_sec``), FLOP/s, MFU.

    FLOPs come from the module's ``flops_per_batch``. The compute dtype (and so the peak MFU is measured
    against) is the stock lookup's: ``OffloadPrecision`` declares it as Lightning's own plugins do.
    This subclass only adds the recipe batch functions and ``peak_tflops``: Lightning knows the peak
    FLOP/s of common GPUs (so MFU is logged there) but not of CPUs; ``peak_tflops`` gives the peak of
    one device (one process) in the dtype of the run, which turns on MFU anywhere.
    """

    def __init__(self, window_size: int = 20, peak_tflops: float | None = None) -> None:
        super().__init__(batch_size_fn=batch_size, length_fn=batch_tokens, window_size=window_size)
        self.peak_tflops = peak_tflops

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Build the throughput meters; override the device's peak FLOP/s when ``peak_tflops`` is given."""
        super().setup(trainer, pl_module, stage)
        if self.peak_tflops is None:
            return
        self.available_flops = int(self.peak_tflops * 1e12)
        for meter in self._throughputs.values():
            meter.available_flops = self.available_flops


def _run_device(accelerator: Any) -> torch.device:
    """The device a Trainer with this ``accelerator`` runs on, for resolving "auto" precision."""
    if accelerator in ("auto", "gpu", "cuda", None) and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


class RecipeTrainer(Trainer):
    """Lightning's Trainer that also takes ``precision="auto"``: the fastest precision of the device it runs on."""

    def __init__(self, precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs: Any) -> None:
        resolved = resolve_precision(precision, _run_device(kwargs.get("accelerator", "auto")))
        super().__init__(precision=resolved, **kwargs)  # type: ignore[arg-type]  # "auto" resolved above


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipe defaults: config overwrite allowed, data checked before ``fit``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import lightning_zero  # noqa: F401  (registers the zero* strategy names)

        # TF32 on Ampere+ for the fp32 parts of mixed precision; no effect on CPUs
        torch.set_float32_matmul_precision("high")
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # the modules configure their own optimizer: no top-level optimizer/lr_scheduler options
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("trainer_class", RecipeTrainer)
        super().__init__(*args, **kwargs)

    def before_fit(self) -> None:
        """Fail before tokenizing or training when the model cannot take the data's sequences."""
        self.model.check_data(self.datamodule)
