"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022, arXiv 2205.05198) beside tensor parallelism.

Between a row-parallel layer and the next column-parallel one, tensor parallelism leaves every rank
with the whole (batch, seq, hidden) activation: LayerNorm, dropout and the residual add run T times
on the same numbers and store T copies. Under sequence parallelism each tensor-parallel rank keeps
only its chunk of the sequence there, (batch, seq/T, hidden):

* a row-parallel layer ends with a reduce-scatter along the sequence instead of an all-reduce;
* a column-parallel layer starts with an all-gather along the sequence instead of the identity
  (its backward reduce-scatters instead of all-reducing), the pairs of
  :mod:`~lightning_zero.parallel.mappings`; an all-gather plus a reduce-scatter move the bytes of
  one all-reduce, so communication stays the same while those activations shrink by T;
* a replicated module inside that region (plan style ``"sequence"``: LayerNorm, and the bias of a
  row-parallel layer) sees one chunk per rank, so its parameters' gradients are partial sums: a
  hook sums them over the tensor-parallel group as they are computed, before ZeRO reduces them
  over the data-parallel group. They stay replicated (not ``tensor_parallel``): norms count them once;
* the region is entered by splitting the output of one replicated module along the sequence (plan
  style ``"sequence_scatter"``, e.g. the embedding: an all-reduce then a split, where Megatron fuses
  the vocabulary-parallel embedding's all-reduce into one reduce-scatter) and left through a
  column-parallel layer (the LM head), whose all-gather restores the whole sequence.

Activations are batch-first here (:data:`SEQUENCE_DIM` = 1), as in this project's models; the
sequence length must be divisible by T. Dropout inside the region draws its mask per chunk from the
same random state on every rank, so masks differ from a run without sequence parallelism (as in
Megatron, whose RNG tracker forks a separate state; parity tests use dropout 0).
"""

from __future__ import annotations

from torch import nn

from lightning_zero import comm
from lightning_zero.parallel.mappings import all_reduce_gradient, scatter_to_sequence_parallel

SEQUENCE_DIM = 1
"""The sequence dimension of (batch, seq, hidden) activations."""


def mark_sequence_parallel(param: nn.Parameter, group: comm.ProcessGroup) -> None:
    """Sum ``param``'s gradients over the tensor-parallel ``group`` (once per parameter, however often
    marked) and mark it ``param.sequence_parallel``. No-op for frozen parameters."""
    if param.requires_grad and not getattr(param, "sequence_parallel", False):
        param.sequence_parallel = True  # type: ignore[attr-defined]  # a tag on the Parameter
        all_reduce_gradient(param, group)


def sequence_region(module: nn.Module, group: comm.ProcessGroup) -> None:
    """Plan style ``"sequence"``: ``module`` (replicated) runs on this rank's sequence chunk; every
    parameter of it gets :func:`mark_sequence_parallel`."""
    for param in module.parameters():
        mark_sequence_parallel(param, group)


def scatter_output(module: nn.Module, group: comm.ProcessGroup) -> None:
    """Plan style ``"sequence_scatter"``: ``module``'s (batch, seq, ...) output, replicated, becomes
    this rank's (batch, seq/T, ...) chunk (backward: all-gather), entering the sequence-parallel region."""
    module.register_forward_hook(lambda _module, _args, out: scatter_to_sequence_parallel(out, group, SEQUENCE_DIM))
