"""GPT-2 written for this project: pre-LN decoder, learned positions, LM head tied to the token embedding.

The model is built as a sequence ``embed -> h[0] ... h[n_layer-1] -> head``, which is also its pipeline
form (``to_layers``). Attention columns are laid out head by head with (q, k, v) inside each head and
the forward infers the number of heads from the tensor shapes, so a column-parallel split of
``c_attn``/``c_fc`` followed by a row-parallel ``c_proj`` (``TENSOR_PARALLEL_PLAN``) runs the same
code on a shard holding whole heads, and under sequence parallelism on a chunk of the sequence. The
plan splits the tied token embedding and LM head by the vocabulary, as Megatron-LM does: the two keep
sharing one shard Parameter, the model then returns logits sharded over the vocabulary, and
:meth:`GPT.loss` takes the vocabulary-parallel cross entropy of them, so the (batch, seq, vocab_size)
logits are never gathered.

Shapes: ``input_ids`` (batch, seq) int64 -> logits (batch, seq, vocab_size) in the compute dtype, or
(batch, seq, vocab_size / T) under tensor parallelism (rank r holds vocabulary ids [r V/T, (r+1) V/T)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.parallel import ColumnParallelLinear, vocab_parallel_cross_entropy


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of a GPT-2. The defaults are GPT-2 small (124M parameters)."""

    vocab_size: int = 50304
    """Rows of the embedding; at least the tokenizer's 50,257. 50,304 = 64 * 786 keeps matmuls aligned."""
    block_size: int = 1024
    """Context length: the number of learned positions, the longest sequence the model accepts."""
    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 768
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (0 for pretraining)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as GPT-2 had."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} is {getattr(self, name)}; it must be at least 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd({self.n_embd}) is not divisible by n_head({self.n_head}); "
                f"choose n_head among the divisors, e.g. {math.gcd(self.n_embd, 64)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout is {self.dropout}; it must lie in [0, 1)")


TENSOR_PARALLEL_PLAN = {
    "h.*.attn.c_attn": "column",
    "h.*.attn.c_proj": "row",
    "h.*.mlp.c_fc": "column",
    "h.*.mlp.c_proj": "row",
    "embed.wte": "vocab",
    "embed": "sequence_scatter",
    "embed.*": "replicate",
    "h.*.ln_*": "sequence",
    "head.ln_f": "sequence",
    "head.lm_head": "column",
}
"""Megatron-style plan, module-name pattern (fnmatch, first match wins) -> "column" | "row" | "vocab" |
"replicate" | "sequence" | "sequence_scatter": one all-reduce per column/row pair in forward and one in
backward. The tied ``embed.wte`` ("vocab") and ``head.lm_head`` ("column") split the same vocabulary
rows and stay one Parameter; ``vocab_size`` must then be divisible by the tensor-parallel size (50,304
is, by 2 to 64). The two sequence styles act only under sequence parallelism (otherwise they mean
"replicate"): the embedding's output is split along the sequence, the LayerNorms run on one chunk
of it per rank, and the column-parallel LM head gathers it back."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, n_embd) -> (batch, seq, n_embd)."""
        qkv = self.c_attn(x)
        # (batch, seq, heads, 3, head_dim): heads and sequence from the projection's shape, so a
        # tensor-parallel shard works too, and so does a sequence-parallel chunk x (c_attn gathers it)
        batch, seq = qkv.shape[:2]
        qkv = qkv.view(batch, seq, -1, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, seq, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward: n_embd -> 4 n_embd -> GELU (tanh form, as GPT-2) -> n_embd."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, n_embd) -> (batch, seq, n_embd)."""
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, n_embd) -> (batch, seq, n_embd)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding: (batch, seq) int64 -> (batch, seq, n_embd)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) int64 -> (batch, seq, n_embd)."""
        seq = input_ids.shape[1]
        if seq > self.block_size:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's block_size({self.block_size})")
        positions = torch.arange(seq, device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class LMHead(nn.Module):
    """Final LayerNorm and the output projection, whose weight *is* the token embedding's (tied)."""

    def __init__(self, config: GPTConfig, wte: nn.Embedding) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, n_embd) -> logits (batch, seq, vocab_size)."""
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """GPT-2 language model. ``forward(input_ids)`` returns logits; ``loss(logits, labels)`` the mean CE."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = LMHead(config, self.embed.wte)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 n_layer), since each block adds two of them
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) int64 -> logits (batch, seq, vocab_size), or (..., vocab_size / T) split by vocabulary."""
        x = self.embed(input_ids)
        for block in self.h:
            x = block(x)
        return self.head(x)

    @staticmethod
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy in fp32; ``labels`` (batch, seq) are already shifted, -100 ignored.

        ``logits`` (batch, seq, vocab_size) whole; for this model's own output use :meth:`loss`."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:meth:`loss_fn` of ``forward``'s logits, whole or, once a tensor-parallel plan split the LM head
        by the vocabulary, sharded (batch, seq, vocab_size / T): then the vocabulary-parallel cross
        entropy, the same fp32 scalar on every tensor-parallel rank (a collective over its group)."""
        head = self.head.lm_head
        if isinstance(head, ColumnParallelLinear):
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), head.group)
        return self.loss_fn(logits, labels)

    def to_layers(self) -> list[nn.Module]:
        """The pipeline form: ``[embed, h[0], ..., h[-1], head]``; chaining them equals ``forward``.

        Apply ``loss_fn`` to the output of the last layer (pipeline schedules take the loss
        separately, as ``torch.distributed.pipelining`` does). The first and the last layer share the
        token-embedding Parameter: a pipeline that puts them on different stages must keep a copy on
        each and all-reduce their gradients (Megatron's tied-embedding group).
        """
        return [self.embed, *self.h, self.head]

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the tied head is counted once, positions excluded when ``non_embedding``."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.wpe.weight.numel() if non_embedding else n
