"""Readable PyTorch versions of every compiled op: the fallback when ``lightning_zero._C`` is not
built, and the yardstick the compiled kernels are tested against.

Each function has the signature and in-place semantics of the op of the same name in
``torch.ops.lightning_zero`` (minus the ``isa`` argument). All arithmetic is fp32; bf16 optimizer
states are widened on load and rounded (nearest even) on store, and the fp32 values, not their
rounding, feed the same step's update, exactly as the kernels do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _bias_corrections(beta1: float, beta2: float, step: int, bias_correction: bool):
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


def _update_moments(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, beta1: float, beta2: float):
    """One step of both moments; returns their fp32 values and stores them (rounded if bf16)."""
    m, v = exp_avg.float(), exp_avg_sq.float()  # the tensors themselves when already fp32
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    if m is not exp_avg:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    return m, v


def cpu_adam_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    param_copy: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float | Tensor,
) -> None:
    """Adam (``adamw_mode=False``: L2 decay in the gradient) or AdamW, as torch.optim computes it.

    param: fp32 (n,); grad: (n,) any float dtype, multiplied by ``grad_scale`` first;
    exp_avg/exp_avg_sq: fp32 or bf16 (n,); param_copy: optional bf16/fp16 (n,) receiving the
    updated param. ``step`` is the 1-based number of the step being taken.
    """
    g = grad.float() * grad_scale
    if not adamw_mode and weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    m, v = _update_moments(g, exp_avg, exp_avg_sq, beta1, beta2)
    if adamw_mode and weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / bc1)
    if param_copy is not None:
        param_copy.copy_(param)


def _lamb_update(
    param: Tensor,
    m: Tensor,
    v: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
) -> Tensor:
    """LAMB's direction before the trust ratio: m_hat / (sqrt(v_hat) + eps) + weight_decay * param."""
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    return (m / denom) * (1.0 / bc1) + weight_decay * param


def _segment_ids(segment_offsets: Tensor, numel: int) -> Tensor:
    lengths = segment_offsets[1:] - segment_offsets[:-1]
    if segment_offsets[0] != 0 or segment_offsets[-1] != numel or (lengths < 0).any():
        raise ValueError(
            f"segment_offsets must rise from 0 to param.numel()={numel}, got {segment_offsets.tolist()[:8]}..."
        )
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def cpu_lamb_moments(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    segment_offsets: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
    grad_scale: float | Tensor,
) -> Tensor:
    """LAMB phase 1: update the moments, return per-segment squared norms.

    ``segment_offsets``: int64 (S + 1,), 0 = o[0] <= ... <= o[S] = n; segment i is
    param[o[i]:o[i+1]], a whole parameter or the piece of one that falls in a ZeRO shard.
    Returns fp32 (S, 2): [sum(param^2), sum(update^2)] per segment (summed in fp64).
    """
    m, v = _update_moments(grad.float() * grad_scale, exp_avg, exp_avg_sq, beta1, beta2)
    update = _lamb_update(param, m, v, beta1, beta2, eps, weight_decay, step, bias_correction)
    ids = _segment_ids(segment_offsets, param.numel()).to(param.device)
    sums = torch.zeros(len(segment_offsets) - 1, 2, dtype=torch.float64, device=param.device)
    sums[:, 0].index_add_(0, ids, param.double().square())
    sums[:, 1].index_add_(0, ids, update.double().square())
    return sums.float()


def lamb_trust_ratio(sq_norms: Tensor) -> Tensor:
    """(S, 2) [sum(param^2), sum(update^2)] -> fp32 (S,) ||param|| / ||update||, 1 where either is 0.

    Call it on the *complete* sums: when a parameter is split over segments or ranks, add its
    pieces (index_add within a rank, all_reduce across ranks) first.
    """
    w, u = sq_norms[:, 0].double().sqrt(), sq_norms[:, 1].double().sqrt()
    return torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w)).float()


def cpu_lamb_apply(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    segment_offsets: Tensor,
    trust_ratio: Tensor,
    param_copy: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
) -> None:
    """LAMB phase 2: param -= lr * trust_ratio[segment] * update, update recomputed from the states.

    trust_ratio: fp32 (S,); other arguments as in :func:`cpu_lamb_moments` / :func:`cpu_adam_step`.
    """
    update = _lamb_update(
        param, exp_avg.float(), exp_avg_sq.float(), beta1, beta2, eps, weight_decay, step, bias_correction
    )
    ids = _segment_ids(segment_offsets, param.numel()).to(param.device)
    param.sub_((trust_ratio.float() * lr)[ids] * update)
    if param_copy is not None:
        param_copy.copy_(param)


def cpu_adagrad_step(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    param_copy: Tensor | None,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float | Tensor,
) -> None:
    """Adagrad as torch.optim.Adagrad computes it (L2 decay in the gradient, ``clr`` decayed by step).

    param: fp32 (n,); grad: (n,), multiplied by ``grad_scale`` first; state_sum: fp32 or bf16 (n,),
    the running sum of squared gradients; ``step`` is the 1-based number of the step being taken.
    """
    g = grad.float() * grad_scale
    if weight_decay != 0:
        g = g.add(param, alpha=weight_decay)
    clr = lr / (1 + (step - 1) * lr_decay)
    s = state_sum.float().addcmul_(g, g)  # a new tensor when state_sum is bf16
    if s is not state_sum:
        state_sum.copy_(s)
    param.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
    if param_copy is not None:
        param_copy.copy_(param)


def cpu_lion_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    param_copy: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float | Tensor,
) -> None:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2)::

        c = beta1 * m + (1 - beta1) * g
        p = p - lr * (sign(c) + weight_decay * p)     # computed as p * (1 - lr * wd) - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    param: fp32 (n,); grad: (n,), multiplied by ``grad_scale`` first; exp_avg: fp32 or bf16 (n,).
    """
    g = grad.float() * grad_scale
    m = exp_avg.float()
    c = m.mul(beta1).add_(g, alpha=1 - beta1)
    param.mul_(1 - lr * weight_decay).sub_(torch.sign(c), alpha=lr)
    exp_avg.copy_(m.mul_(beta2).add_(g, alpha=1 - beta2))
    if param_copy is not None:
        param_copy.copy_(param)


SUM_SQUARES_CHUNK = 1 << 20
"""Elements per chunk of :func:`cpu_sum_squares` (the compiled op hands chunks of this size to threads)."""


def cpu_sum_squares(x: Tensor) -> Tensor:
    """Sum of squares of a contiguous CPU tensor, a 0-dim fp32 tensor (fp64 for fp64 input): chunks
    of :data:`SUM_SQUARES_CHUNK` elements, each ``vector_norm(chunk) ** 2`` in fp32, added in order.
    A 16-bit tensor is widened one chunk at a time into a cache-sized fp32 buffer (exact, so it
    gives the sum of its fp32 cast, bit for bit, without a whole fp32 copy). The compiled op adds
    in another order (its own blocks, in double): the two agree to fp32 rounding, not bitwise."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = x.reshape(-1)
    scratch = None if flat.dtype == dtype else torch.empty(min(SUM_SQUARES_CHUNK, flat.numel()), dtype=dtype)
    total = torch.zeros((), dtype=dtype)
    for start in range(0, flat.numel(), SUM_SQUARES_CHUNK):
        piece = flat[start : start + SUM_SQUARES_CHUNK]
        if scratch is not None:
            piece = scratch[: piece.numel()].copy_(piece)
        total += torch.linalg.vector_norm(piece, dtype=dtype).square()
    return total


def _whole(t: Tensor) -> Tensor:
    return torch.tensor([0, t.numel()], dtype=torch.long)


def _scale(grad_scale: Tensor | None) -> float | Tensor:
    return 1.0 if grad_scale is None else grad_scale.float()


def fused_adam_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    param_copies: Sequence[Tensor],
    grad_scale: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw_mode: bool,
    bias_correction: bool,
) -> None:
    """Multi-tensor Adam: :func:`cpu_adam_step` on each list entry (any device)."""
    copies: list[Tensor | None] = list(param_copies) or [None] * len(params)
    for p, g, m, v, c in zip(params, grads, exp_avgs, exp_avg_sqs, copies, strict=True):
        cpu_adam_step(
            p.view(-1),
            g.reshape(-1),
            m.view(-1),
            v.view(-1),
            None if c is None else c.view(-1),
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            adamw_mode,
            bias_correction,
            _scale(grad_scale),
        )


def fused_lamb_moments(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    grad_scale: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
) -> Tensor:
    """Multi-tensor LAMB phase 1: fp32 (len(params), 2) squared norms, one row per tensor."""
    rows = [
        cpu_lamb_moments(
            p.view(-1),
            g.reshape(-1),
            m.view(-1),
            v.view(-1),
            _whole(p),
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            bias_correction,
            _scale(grad_scale),
        )
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    ]
    return torch.cat(rows) if rows else torch.zeros(0, 2)


def fused_lamb_apply(
    params: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    trust_ratio: Tensor,
    param_copies: Sequence[Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
) -> None:
    """Multi-tensor LAMB phase 2; trust_ratio: fp32 (len(params),)."""
    copies: list[Tensor | None] = list(param_copies) or [None] * len(params)
    for i, (p, m, v, c) in enumerate(zip(params, exp_avgs, exp_avg_sqs, copies, strict=True)):
        cpu_lamb_apply(
            p.view(-1),
            m.view(-1),
            v.view(-1),
            _whole(p),
            trust_ratio[i : i + 1],
            None if c is None else c.view(-1),
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step,
            bias_correction,
        )
