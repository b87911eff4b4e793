"""BERT written for this project: post-LN encoder, MLM head tied to the word embeddings, optional NSP.

Built as ``embed -> layer[0] ... layer[n-1] -> mlm_head`` (the pipeline form, ``to_layers``). As in the
GPT-2 recipe, attention columns are laid out head by head with (q, k, v) inside each head and the
forward infers the head count from shapes, so ``TENSOR_PARALLEL_PLAN`` shards run the same code.
The plan splits the word embedding and the MLM decoder tied to it by the vocabulary (one shard
Parameter for both; the decoder's bias is split alike): MLM logits are then sharded over the
vocabulary, and :meth:`Bert.mlm_loss` / :meth:`Bert.mlm_predictions` never gather them.

The MLM head runs only on the masked positions (NVIDIA's BERT does the same): with 15% masking that
saves ~85% of the vocabulary projection, the largest matmul of a small BERT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.parallel import ColumnParallelLinear, vocab_parallel_argmax, vocab_parallel_cross_entropy


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Sizes of a BERT. The defaults are BERT-base (110M parameters)."""

    vocab_size: int = 30522
    """Rows of the word embedding; at least the tokenizer's 30,522."""
    max_position: int = 512
    """Learned positions: the longest sequence the model accepts."""
    type_vocab_size: int = 2
    """Segment (token type) embeddings: sentence A and B."""
    n_layer: int = 12
    """Encoder layers."""
    n_head: int = 12
    """Attention heads; must divide ``hidden``."""
    hidden: int = 768
    """Width of the residual stream."""
    intermediate: int = 3072
    """Width of the feed-forward layer."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon, as the original BERT."""
    nsp: bool = False
    """Add the next-sentence-prediction head (pooler + 2-way classifier)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_position", "type_vocab_size", "n_layer", "n_head", "hidden", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name} is {getattr(self, name)}; it must be at least 1")
        if self.hidden % self.n_head:
            raise ValueError(
                f"BertConfig.hidden({self.hidden}) is not divisible by n_head({self.n_head}); "
                f"choose n_head among the divisors, e.g. {math.gcd(self.hidden, 64)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"BertConfig.dropout is {self.dropout}; it must lie in [0, 1)")


TENSOR_PARALLEL_PLAN = {
    "layer.*.attn.qkv": "column",
    "layer.*.attn.out": "row",
    "layer.*.ffn.fc_in": "column",
    "layer.*.ffn.fc_out": "row",
    "layer.*.ln_*": "replicate",
    "embed.word": "vocab",
    "embed.*": "replicate",
    "mlm_head.dense": "replicate",
    "mlm_head.ln": "replicate",
    "mlm_head.decoder": "column",
    "nsp_head.*": "replicate",
}
"""Megatron-style plan, module-name pattern (fnmatch, first match wins) -> "column" | "row" | "vocab" |
"replicate". The tied ``embed.word`` ("vocab") and ``mlm_head.decoder`` ("column") split the same
vocabulary rows and stay one Parameter; ``vocab_size`` must then be divisible by the tensor-parallel
size (BERT's 30,522 is by 2 only; pad it, e.g. to 30,528 = 64 * 477, for more)."""


class Embeddings(nn.Module):
    """Word + position + segment embeddings, then LayerNorm and dropout: (batch, seq) -> (batch, seq, hidden)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.max_position = config.max_position
        self.word = nn.Embedding(config.vocab_size, config.hidden)
        self.position = nn.Embedding(config.max_position, config.hidden)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq) int64 [and segment ids, default all 0] -> (batch, seq, hidden)."""
        seq = input_ids.shape[1]
        if seq > self.max_position:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's max_position({self.max_position})")
        x = self.word(input_ids) + self.position(torch.arange(seq, device=input_ids.device))
        if token_type_ids is not None:
            x = x + self.token_type(token_type_ids)
        else:  # segment 0 everywhere: add its row without materializing a zero index tensor
            x = x + self.token_type.weight[0]
        return self.drop(self.ln(x))


class SelfAttention(nn.Module):
    """Bidirectional multi-head attention; ``pad_mask`` (batch, seq) bool, True at real tokens."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.head_dim = config.hidden // config.n_head
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden), before the residual dropout."""
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        mask = None if pad_mask is None else pad_mask[:, None, None, :]  # broadcast over heads and queries
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """hidden -> intermediate -> GELU (erf form, as BERT) -> hidden."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden, config.intermediate)
        self.fc_out = nn.Linear(config.intermediate, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden)."""
        return self.fc_out(F.gelu(self.fc_in(x)))


class EncoderLayer(nn.Module):
    """Post-LN layer: ``ln_1(x + attn(x))`` then ``ln_2(x + ffn(x))``. Takes and returns ``(x, pad_mask)``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, seq, hidden)."""
        x = self.ln_1(x + self.drop(self.attn(x, pad_mask)))
        return self.ln_2(x + self.drop(self.ffn(x)))


class MLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the decoder tied to the word embeddings (plus its own bias)."""

    def __init__(self, config: BertConfig, word: nn.Embedding) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden, config.vocab_size)
        self.decoder.weight = word.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> logits (..., vocab_size)."""
        return self.decoder(self.ln(F.gelu(self.dense(x))))


class NSPHead(nn.Module):
    """Pooler (dense + tanh on the [CLS] position) and the is-next classifier: (batch, seq, hidden) -> (batch, 2)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.pooler = nn.Linear(config.hidden, config.hidden)
        self.classifier = nn.Linear(config.hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> logits (batch, 2)."""
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class Bert(nn.Module):
    """BERT for pretraining. ``forward`` returns (MLM logits at the masked positions, NSP logits or None)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layer))
        self.mlm_head = MLMHead(config, self.embed.word)
        self.nsp_head = NSPHead(config) if config.nsp else None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # BERT: truncated normal, std 0.02, for every Linear and Embedding; zero biases
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, mean=0.0, std=0.02, a=-0.04, b=0.04)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def encode(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None, pad_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(batch, seq) int64 -> hidden states (batch, seq, hidden)."""
        x = self.embed(input_ids, token_type_ids)
        for layer in self.layer:
            x = layer(x, pad_mask)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLM logits (n_masked, vocab_size) at the positions where ``labels != -100`` (vocab_size / T when
        split by a tensor-parallel plan; see :meth:`mlm_loss`), and NSP logits (batch, 2)."""
        x = self.encode(input_ids, token_type_ids, pad_mask)
        mlm_logits = self.mlm_head(x[labels != -100])
        nsp_logits = self.nsp_head(x) if self.nsp_head is not None else None
        return mlm_logits, nsp_logits

    def _split_decoder(self) -> ColumnParallelLinear | None:
        """The decoder when a tensor-parallel plan split it by the vocabulary, else None."""
        decoder = self.mlm_head.decoder
        return decoder if isinstance(decoder, ColumnParallelLinear) else None

    def mlm_loss(self, mlm_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy (fp32) of ``forward``'s MLM logits (n_masked, vocab_size), or (n_masked,
        vocab_size / T) once a tensor-parallel plan split the decoder by vocabulary, against (n_masked,)
        int64 targets; under tensor parallelism a collective over its group."""
        split = self._split_decoder()
        if split is None:
            return F.cross_entropy(mlm_logits.float(), targets)
        return vocab_parallel_cross_entropy(mlm_logits, targets, split.group)

    def mlm_predictions(self, mlm_logits: torch.Tensor) -> torch.Tensor:
        """(n_masked,) int64 predicted token ids of ``forward``'s MLM logits, whole or vocabulary-sharded."""
        split = self._split_decoder()
        return mlm_logits.argmax(-1) if split is None else vocab_parallel_argmax(mlm_logits, split.group)

    def to_layers(self) -> list[nn.Module]:
        """The pipeline form ``[embed, layer[0], ..., layer[-1], mlm_head]`` (all positions; MLM only).

        Chaining them maps input_ids (batch, seq) to logits (batch, seq, vocab_size); apply
        ``F.cross_entropy(..., ignore_index=-100)`` to the last output. Without padding no mask is
        needed. The first and last layer share the word-embedding Parameter (tied; see GPT.to_layers).
        """
        return [self.embed, *self.layer, self.mlm_head]

    def num_params(self) -> int:
        """Parameter count, the tied decoder weight counted once."""
        return sum(p.numel() for p in self.parameters())
