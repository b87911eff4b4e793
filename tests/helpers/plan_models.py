"""Models the plan's tensor- and pipeline-parallel tests build both on the meta device (the plan) and
on real gloo ranks: the recipes' GPT-2 at a tiny size, with its tensor-parallel plan and pipeline spec."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero import PipelineSpec


class PlannedGPT(nn.Module):
    """The recipes' GPT-2 (tied embedding and LM head), by default tiny: vocabulary 96, 48 wide,
    4 heads, 17 positions. ``forward(ids)`` returns the logits; the pipeline's batch is ``(rows,)``
    of ``seq + 1`` token ids (inputs and the shifted labels), as a DataLoader over a TensorDataset yields."""

    def __init__(
        self, n_layer: int = 3, vocab_size: int = 96, n_embd: int = 48, n_head: int = 4, seq: int = 16
    ) -> None:
        super().__init__()
        from recipes.gpt2.model import GPT, GPTConfig

        config = GPTConfig(vocab_size=vocab_size, block_size=seq + 1, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        self.model = GPT(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def tensor_parallel_plan(self) -> dict[str, str]:
        from recipes.gpt2.model import TENSOR_PARALLEL_PLAN

        return {f"model.{k}": v for k, v in TENSOR_PARALLEL_PLAN.items()}

    def configure_pipeline(self) -> PipelineSpec:
        return PipelineSpec(
            layers=self.model.to_layers(),
            loss=lambda logits, batch: self.model.loss(logits, batch[0][:, 1:]),
            inputs=lambda batch: batch[0][:, :-1],
        )
