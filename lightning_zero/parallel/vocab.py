"""Losses and predictions from logits sharded over the vocabulary, without gathering them.

A tied embedding / LM head pair split by the plan (``"vocab"`` for the Embedding, ``"column"`` for
the head Linear: :func:`~lightning_zero.parallel.apply_tensor_parallel` keeps them sharing one shard
Parameter) yields logits of shape (..., V/T) holding columns ``[r*V/T, (r+1)*V/T)`` on tensor-parallel
rank r, as Megatron-LM's output layer does. The full (..., V) logits, the largest activation of a
small language model, then never exist on any rank: the cross entropy needs three all-reduces of
(N,) and the argmax two.

Every function here is a collective over the tensor-parallel ``group``: call it on all of its ranks,
in the same order, with the same shapes. With a one-rank group each equals its plain PyTorch form.
"""

from __future__ import annotations

import torch

from lightning_zero import comm
from lightning_zero.parallel.mappings import reduce_from_tensor_parallel


def _vocab_start(logits: torch.Tensor, group: comm.ProcessGroup) -> int:
    return comm.rank(group) * logits.shape[-1]


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: comm.ProcessGroup, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross entropy from logits sharded over the vocabulary, without gathering them.

    Args:
        logits: (N, V/T) this rank's vocabulary columns [r*V/T, (r+1)*V/T); computed in fp32.
        target: (N,) int64 global vocabulary ids; ``ignore_index`` entries do not count.
        group: the tensor-parallel group.

    Returns the same fp32 scalar on every rank, ``F.cross_entropy(full_logits, target)`` up to the
    order of summation. Three all-reduces of (N,): max, target logit, sum of exponentials. Call on
    all ranks.
    """
    logits = logits.float()
    shard = logits.shape[-1]
    start = _vocab_start(logits, group)
    # The max only stabilizes exp(); the loss does not depend on it, so no gradient flows through it.
    row_max = logits.detach().amax(dim=-1)
    comm.all_reduce(row_max, group, op=torch.distributed.ReduceOp.MAX, label="tensor_parallel")
    shifted = logits - row_max.unsqueeze(-1)
    valid = target != ignore_index
    local = target - start
    mine = valid & (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * mine
    picked = reduce_from_tensor_parallel(picked, group)
    sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(dim=-1), group)
    losses = (sum_exp.log() - picked) * valid
    return losses.sum() / valid.sum().clamp_min(1)


def vocab_parallel_argmax(logits: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
    """``full_logits.argmax(-1)`` from logits sharded over the vocabulary (no gradient).

    Args:
        logits: (..., V/T) this rank's vocabulary columns, any float dtype.
        group: the tensor-parallel group.

    Returns (...) int64 global vocabulary ids, equal on every rank; ties go to the smallest id, as
    ``torch.argmax`` does. Two all-reduces of (...): the maximum, then the smallest id holding it.
    Call on all ranks.
    """
    local_max, local_arg = logits.detach().float().max(dim=-1)
    best = local_max.clone()
    comm.all_reduce(best, group, op=torch.distributed.ReduceOp.MAX, label="tensor_parallel")
    vocab = logits.shape[-1] * comm.world_size(group)
    # Only ranks whose own maximum is the global one offer an id; the others offer one past the end.
    ids = torch.where(local_max == best, local_arg + _vocab_start(logits, group), torch.full_like(local_arg, vocab))
    comm.all_reduce(ids, group, op=torch.distributed.ReduceOp.MIN, label="tensor_parallel")
    return ids
