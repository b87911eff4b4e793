"""The BERT LightningModule: MLM (+ optional NSP) loss, MLM accuracy, FLOPs per batch, LAMB or AdamW."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torchmetrics.classification import MulticlassAccuracy

from lightning_zero import PipelineSpec, load_pretrained
from recipes.bert.model import TENSOR_PARALLEL_PLAN, Bert, BertConfig
from recipes.common import optim
from recipes.common.flops import transformer_training_flops
from recipes.common.from_hf import bert_mapping

_BERT_OPTIMIZER = optim.OptimizerConfig(
    name="lamb",
    lr=6e-3,
    weight_decay=0.01,
    betas=(0.9, 0.999),
    eps=1e-6,
    schedule="poly",
    decay_power=0.5,
    min_lr_ratio=0.0,
)


class BertMLM(LightningModule):
    """Masked language modelling with ``recipes.bert.model.Bert``.

    Logs ``train_loss`` every step, ``val_loss`` and ``val_mlm_acc`` (torchmetrics accuracy over
    the masked positions) per validation. Built in ``configure_model``, like the GPT-2 recipe.

    Args:
        config: the model's sizes (``nsp`` adds the next-sentence head; the data must match).
        optimizer: optimizer and schedule; by default LAMB with warmup and polynomial decay.
        init_from: an HF ``BertForMaskedLM.save_pretrained`` directory to start from; ``None``: random.
    """

    def __init__(
        self,
        config: BertConfig = BertConfig(),  # noqa: B008 (frozen dataclass: a shared default is safe)
        optimizer: optim.OptimizerConfig = _BERT_OPTIMIZER,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config, self.optimizer_config, self.init_from = config, optimizer, init_from
        self.model: Bert | None = None
        self.val_acc = MulticlassAccuracy(num_classes=config.vocab_size, average="micro", ignore_index=-100)
        self.flops_per_batch = 0

    def configure_model(self) -> None:
        """Build the BERT (once; Lightning may call this again when restoring); with ``init_from``, load
        an HF ``BertForMaskedLM`` (or ``BertForPreTraining``) directory into it."""
        if self.model is None:
            self.model = Bert(self.config)
            if self.init_from is not None:
                load_pretrained(self.model, self.init_from, mapping=bert_mapping(self.config.n_head))

    def check_data(self, datamodule) -> None:
        """ValueError when the data cannot feed this model: sequences too long, vocabulary or NSP mismatch."""
        if datamodule.seq_len > self.config.max_position:
            raise ValueError(
                f"data.seq_len({datamodule.seq_len}) is above the model's context "
                f"config.max_position({self.config.max_position}); lower data.seq_len or raise model.config.max_position"
            )
        vocab = datamodule.tokenizer.vocab_size
        if vocab > self.config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} tokens but config.vocab_size is {self.config.vocab_size}")
        if datamodule.nsp != self.config.nsp:
            raise ValueError(
                f"data.nsp({datamodule.nsp}) and model.config.nsp({self.config.nsp}) differ; set both the same"
            )

    def setup(self, stage: str) -> None:
        """Check the data and compute the FLOPs of one micro-batch for the ThroughputMonitor."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is None:
            return
        self.check_data(datamodule)
        c = self.config
        self.flops_per_batch = transformer_training_flops(
            batch=datamodule.batch_size,
            seq=datamodule.seq_len,
            n_layer=c.n_layer,
            d_model=c.hidden,
            d_ff=c.intermediate,
            vocab=c.vocab_size,
            head_positions=datamodule.batch_size * datamodule.seq_len * datamodule.mask_prob,
            head_dense=True,
        )

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        mlm_logits, nsp_logits = self.model(batch["input_ids"], labels, batch.get("token_type_ids"))
        targets = labels[labels != -100]
        loss = self.model.mlm_loss(mlm_logits, targets)
        if nsp_logits is not None:
            loss = loss + F.cross_entropy(nsp_logits.float(), batch["next_sentence_label"])
        return loss, mlm_logits, targets

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLM logits at the masked positions (``labels != -100``) and NSP logits; see ``Bert.forward``."""
        return self.model(input_ids, labels)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """MLM cross entropy over the masked positions (+ NSP cross entropy)."""
        loss, _, _ = self._losses(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate validation loss and MLM accuracy (reduced across ranks at the end of validation)."""
        loss, mlm_logits, targets = self._losses(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.val_acc.update(self.model.mlm_predictions(mlm_logits), targets)
        self.log("val_mlm_acc", self.val_acc, prog_bar=True)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The BERT's Megatron plan (``TENSOR_PARALLEL_PLAN``) under this module's ``model.`` prefix, read by
        ``ZeroStrategy(tensor_parallel_size=T)``; without the NSP head's pattern when there is none."""
        return {
            f"model.{pattern}": style
            for pattern, style in TENSOR_PARALLEL_PLAN.items()
            if self.config.nsp or not pattern.startswith("nsp_head")
        }

    def configure_pipeline(self) -> PipelineSpec:
        """The BERT as ``[embed, layer[0], ..., layer[-1], mlm_head]`` for ``ZeroStrategy(pipeline_parallel_size=P)``:
        the masked-LM loss on the last stage (the head runs on every position there). Only
        ``val_loss`` is logged under a pipeline (the accuracy needs the logits, which stay on the last stage)."""
        assert self.model is not None, "configure_model() builds the model first"
        if self.config.nsp:
            raise ValueError(
                "pipeline parallelism runs BERT's masked-LM objective only (the NSP head reads the [CLS] state "
                "beside the MLM head); set model.config.nsp=false or pipeline_parallel_size=1"
            )
        model = self.model

        def loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            masked = batch["labels"] != -100
            return model.mlm_loss(logits[masked], batch["labels"][masked])

        return PipelineSpec(
            layers=model.to_layers(),
            loss=loss,
            inputs=lambda batch: (batch["input_ids"], batch["token_type_ids"]),
        )

    def configure_optimizers(self) -> dict:
        """The configured optimizer with a per-step warmup + decay schedule over ``trainer.max_steps``."""
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        return optim.configure(self.optimizer_config, self.model, int(total))
