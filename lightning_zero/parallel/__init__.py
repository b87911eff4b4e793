"""Model parallelism beside ZeRO's data parallelism: tensor parallelism (:mod:`.tensor`) built from
the autograd pairs of :mod:`.mappings`, with losses over vocabulary-sharded logits (:mod:`.vocab`).
Process groups come from :mod:`lightning_zero.layout`."""

from lightning_zero.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    is_tensor_parallel,
)
from lightning_zero.parallel.vocab import vocab_parallel_argmax, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "is_tensor_parallel",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
]
