"""The GPT-2 LightningModule: next-token loss, perplexity, FLOPs per batch, AdamW with cosine decay."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lightning_zero import PipelineSpec, load_pretrained
from recipes.common import optim
from recipes.common.flops import transformer_training_flops
from recipes.common.from_hf import gpt2_mapping
from recipes.gpt2.model import GPT, TENSOR_PARALLEL_PLAN, GPTConfig


class GPT2LM(LightningModule):
    """Causal language modelling with ``recipes.gpt2.model.GPT``.

    Logs ``train_loss`` every step, ``val_loss`` and ``val_ppl`` per validation: ``exp`` of the mean
    loss per token over all validation tokens, what torchmetrics' Perplexity computes, but from the
    loss, so that logits sharded over the vocabulary (tensor parallelism) are never gathered. The
    model is built in ``configure_model`` so that sharding strategies can build it where they want
    (Lightning calls that hook inside the strategy's context).

    Args:
        config: the model's sizes.
        optimizer: optimizer and schedule (``name: adamw`` or ``lamb``).
        init_from: an HF ``GPT2LMHeadModel.save_pretrained`` directory to start from (the vocabulary
            must match its, e.g. 50257); ``None``: GPT-2's random initialization.
    """

    def __init__(
        self,
        config: GPTConfig = GPTConfig(),  # noqa: B008 (frozen dataclass: a shared default is safe)
        optimizer: optim.OptimizerConfig = optim.OptimizerConfig(),  # noqa: B008 (frozen dataclass)
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config, self.optimizer_config, self.init_from = config, optimizer, init_from
        self.model: GPT | None = None
        self.val_nll = MeanMetric()  # per-token loss, weighted by the tokens of each batch
        self.flops_per_batch = 0

    def configure_model(self) -> None:
        """Build the GPT (once; Lightning may call this again when restoring); with ``init_from``, load
        an HF ``GPT2LMHeadModel`` directory into it (streamed into the shards under stage 3)."""
        if self.model is None:
            self.model = GPT(self.config)
            if self.init_from is not None:
                load_pretrained(self.model, self.init_from, mapping=gpt2_mapping(self.config.n_head))

    def check_data(self, datamodule) -> None:
        """ValueError when the data cannot feed this model: sequences too long or tokens outside the vocabulary."""
        if datamodule.seq_len > self.config.block_size:
            raise ValueError(
                f"data.seq_len({datamodule.seq_len}) is above the model's context "
                f"config.block_size({self.config.block_size}); lower data.seq_len or raise model.config.block_size"
            )
        vocab = datamodule.tokenizer.vocab_size
        if vocab > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but config.vocab_size is {self.config.vocab_size}; "
                f"set model.config.vocab_size to at least {vocab} (50304 keeps matmuls aligned)"
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
            d_model=c.n_embd,
            d_ff=4 * c.n_embd,
            vocab=c.vocab_size,
            head_positions=datamodule.batch_size * datamodule.seq_len,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) int64 -> logits (batch, seq, vocab_size)."""
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean next-token cross entropy of the micro-batch."""
        loss = self.model.loss(self.model(batch["input_ids"]), batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Accumulate validation loss and perplexity (reduced across ranks at the end of validation)."""
        loss = self.model.loss(self.model(batch["input_ids"]), batch["labels"])
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.val_nll.update(loss, weight=(batch["labels"] != -100).sum())

    def on_validation_epoch_end(self) -> None:
        """``val_ppl``: exp of the mean loss per token over the whole validation set (all ranks; the
        ranks of a tensor-parallel group hold equal numbers, which leave the weighted mean unchanged)."""
        # compute() already reduced over all ranks; sync_dist averages equal values (no change) and
        # tells Lightning the epoch-level value is global (else it warns on every validation)
        self.log("val_ppl", self.val_nll.compute().exp(), sync_dist=True)
        self.val_nll.reset()

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The GPT's Megatron plan (``TENSOR_PARALLEL_PLAN``) under this module's ``model.`` prefix, read by
        ``ZeroStrategy(tensor_parallel_size=T)``."""
        return {f"model.{pattern}": style for pattern, style in TENSOR_PARALLEL_PLAN.items()}

    def configure_pipeline(self) -> PipelineSpec:
        """The GPT as ``[embed, h[0], ..., h[-1], head]`` for ``ZeroStrategy(pipeline_parallel_size=P)``: the
        loss runs on the last stage, the tied embedding/head is kept on the first and last, and
        ``val_ppl`` comes from each validation batch's true loss (``on_eval``)."""
        assert self.model is not None, "configure_model() builds the model first"
        model = self.model
        return PipelineSpec(
            layers=model.to_layers(),
            loss=lambda logits, batch: model.loss(logits, batch["labels"]),
            inputs=lambda batch: batch["input_ids"],
            on_eval=lambda loss, batch: self.val_nll.update(loss, weight=(batch["labels"] != -100).sum()),
        )

    def configure_optimizers(self) -> dict:
        """The configured optimizer with a per-step warmup + decay schedule over ``trainer.max_steps``."""
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else self.trainer.estimated_stepping_batches
        return optim.configure(self.optimizer_config, self.model, int(total))
