"""Models that read parameters across module boundaries, as real models do (stage 3 gather units).

* :class:`CrossReads`: a tied output head computed functionally, a sibling's weight used through a
  functional call, ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` hands ``out_proj.weight``
  to the functional attention), a parameter the LightningModule holds itself read in
  ``training_step``, and an L2 penalty over ``self.parameters()``.
* :class:`HFSeq2Seq`: Hugging Face ``T5ForConditionalGeneration`` (``T5DenseActDense`` reads
  ``wo.weight.dtype``), tiny except ``d_ff`` (above the default persistence threshold).
* :class:`LoraLlama`: PEFT LoRA on a tiny ``LlamaForCausalLM`` (``lora.Linear`` reads
  ``lora_A.weight``), ``r`` large enough for the LoRA matrices to be sharded at the default threshold.

Widths are odd so that shards cut through parameters.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 29, 7


class Mixer(nn.Module):
    """Uses a sibling's weight through a functional call (the sibling is not its submodule)."""

    def __init__(self, width: int, partner: nn.Linear) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self._partner = [partner]  # a plain list: not registered as a child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partner = self._partner[0]
        return self.gate(x) * torch.sigmoid(F.linear(x, partner.weight, partner.bias))


class CrossReads(pl.LightningModule):
    """``width`` 331: every matrix is above the default persistence threshold (100,000 elements)."""

    def __init__(self, width: int = 331, penalty: float = 1e-3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.side = nn.Linear(width, width)
        self.mixer = Mixer(width, self.side)
        # bias=False: the key projection's bias gets no gradient in exact arithmetic (softmax ignores a
        # shift), only rounding noise, which Adam scales up to steps of ~lr that differ between any two
        # summation orders (DDP's and ZeRO's), so weights could not be compared.
        self.encoder = nn.TransformerEncoderLayer(
            width, nhead=1, dim_feedforward=width, dropout=0.0, batch_first=True, bias=False
        )
        self.proj = nn.Parameter(torch.randn(width, width) / width**0.5)  # held by the LightningModule
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.penalty = penalty
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(self.mixer(h))
        return h @ self.emb.weight.t()  # tied head, computed functionally

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(self.mixer(h)) @ self.proj
        logits = F.linear(h, self.emb.weight) / self.temperature
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss + self.penalty * sum(p.pow(2).sum() for p in self.parameters())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CrossReadsLoss(CrossReads):
    """For Fabric, where the root module's forward is the step: the loss of ``training_step``."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.training_step((tokens,), 0)


class HFSeq2Seq(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=VOCAB,
            d_model=16,
            d_kv=8,
            d_ff=6301,  # wi/wo: 100,816 elements, above the default persistence threshold
            num_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        self.model = T5ForConditionalGeneration(config)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens.flip(1)).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LoraLlama(pl.LightningModule):
    def __init__(self, r: int = 6301) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = get_peft_model(LlamaForCausalLM(config), lora)
        # lora_B starts at zero (no gradient reaches lora_A on the first step): give it values, as
        # after some training, so both LoRA matrices move from the first step on.
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def loader(n: int = 24, batch_size: int = 3) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1234))
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, shuffle=False)
