"""Train a Hugging Face ``transformers`` model with the recipes' data and any lightning_zero strategy.

Users bring their own models: ``HFLightningModule(GPT2LMHeadModel(GPT2Config(...)))`` with
``GPT2DataModule``, or ``BertForMaskedLM`` with ``BertDataModule``, trains unchanged under
``Trainer(strategy="zero2")``. Models are built from a config (no download; this machine is offline).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn

from recipes.common.optim import OptimizerConfig, configure


class HFLightningModule(LightningModule):
    """Wraps a ``transformers`` model whose forward takes ``labels`` and returns an output with ``.loss``.

    ``causal``: the batch's ``labels`` are the recipes' pre-shifted next tokens, while HF causal LMs
    shift internally, so the model gets ``labels=input_ids`` instead. Masked LMs get the batch as is.
    """

    def __init__(self, model: nn.Module, causal: bool, optimizer: OptimizerConfig | None = None) -> None:
        super().__init__()
        self.model, self.causal = model, causal
        self.optimizer_config = optimizer or OptimizerConfig(lr=1e-3)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "token_type_ids")}
        if self.causal:
            inputs["labels"] = batch["input_ids"]
            inputs.pop("token_type_ids", None)
        return self.model(**inputs).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The model's own loss on the batch."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """The model's own loss on a validation batch."""
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> dict:
        """AdamW (or the configured optimizer) with its schedule over ``trainer.max_steps``."""
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        return configure(self.optimizer_config, self.model, int(total))
