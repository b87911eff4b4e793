"""Typed entry points of the optimizer ops: the compiled kernel when built, else the reference.

These are what the ZeRO engine calls on its flat fp32 shards. CPU functions take one contiguous
flat range; ``fused_*`` take lists of tensors on one device. For LAMB on ZeRO shards the protocol is:

1. ``sq = cpu_lamb_moments(shard, grad, m, v, segment_offsets, ...)``  -> (S, 2) per segment
2. add each parameter's pieces (``index_add_`` within the rank, then ``all_reduce`` across ranks)
3. ``trust = lamb_trust_ratio(per_param_sq)``, gathered back to this rank's segments
4. ``cpu_lamb_apply(shard, m, v, segment_offsets, trust_per_segment, ...)``
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.ops import reference
from lightning_zero.ops._load import cpu_path, fused_path
from lightning_zero.ops.reference import lamb_trust_ratio

__all__ = [
    "cpu_adam_step",
    "cpu_lamb_moments",
    "cpu_lamb_apply",
    "cpu_adagrad_step",
    "cpu_lion_step",
    "cpu_sum_squares",
    "lamb_trust_ratio",
    "fused_adam_step",
    "fused_lamb_moments",
    "fused_lamb_apply",
]


def cpu_adam_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_copy: Tensor | None = None,
) -> None:
    """One Adam/AdamW step in a single pass, in place.

    param: fp32 contiguous CPU tensor of n elements (any shape); grad: fp32 or bf16 (widened in
    registers, exactly: the step of ``grad.float()`` without that copy), n elements; exp_avg,
    exp_avg_sq: fp32 or bf16 (both the same), n elements; param_copy: optional bf16/fp16, n elements,
    receives the updated param (the device copy). grad is multiplied by ``grad_scale`` (unscale x
    clip coefficient) first, one fp32 product. ``step``: 1 for the first step.
    """
    args = (lr, beta1, beta2, eps, weight_decay, step, adamw_mode, bias_correction, grad_scale)
    path = cpu_path()
    if path == "reference":
        return reference.cpu_adam_step(param, grad, exp_avg, exp_avg_sq, param_copy, *args)
    torch.ops.lightning_zero.cpu_adam_step(param, grad, exp_avg, exp_avg_sq, param_copy, *args, path)


def cpu_lamb_moments(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    segment_offsets: Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
) -> Tensor:
    """LAMB phase 1 (see the module docstring): update the moments in place, return fp32 (S, 2).

    segment_offsets: int64 CPU (S + 1,) from 0 to param.numel(); row i of the result is
    [sum(param^2), sum(update^2)] over param[o[i]:o[i+1]].
    """
    args = (beta1, beta2, eps, weight_decay, step, bias_correction, grad_scale)
    path = cpu_path()
    if path == "reference":
        return reference.cpu_lamb_moments(param, grad, exp_avg, exp_avg_sq, segment_offsets, *args)
    return torch.ops.lightning_zero.cpu_lamb_moments(param, grad, exp_avg, exp_avg_sq, segment_offsets, *args, path)


def cpu_lamb_apply(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    segment_offsets: Tensor,
    trust_ratio: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool = True,
    param_copy: Tensor | None = None,
) -> None:
    """LAMB phase 2: param -= lr * trust_ratio[segment] * update; trust_ratio fp32 (S,)."""
    args = (lr, beta1, beta2, eps, weight_decay, step, bias_correction)
    path = cpu_path()
    if path == "reference":
        return reference.cpu_lamb_apply(param, exp_avg, exp_avg_sq, segment_offsets, trust_ratio, param_copy, *args)
    torch.ops.lightning_zero.cpu_lamb_apply(
        param, exp_avg, exp_avg_sq, segment_offsets, trust_ratio, param_copy, *args, path
    )


def cpu_adagrad_step(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    *,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    param_copy: Tensor | None = None,
) -> None:
    """One Adagrad step (torch.optim.Adagrad's rule) in a single pass, in place.

    param, grad: fp32 contiguous CPU tensors of n elements; state_sum: fp32 or bf16, n elements;
    param_copy and grad_scale as in :func:`cpu_adam_step`. ``step``: 1 for the first step.
    """
    args = (lr, lr_decay, eps, weight_decay, step, grad_scale)
    path = cpu_path()
    if path == "reference":
        return reference.cpu_adagrad_step(param, grad, state_sum, param_copy, *args)
    torch.ops.lightning_zero.cpu_adagrad_step(param, grad, state_sum, param_copy, *args, path)


def cpu_lion_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    param_copy: Tensor | None = None,
) -> None:
    """One Lion step (see :func:`lightning_zero.ops.reference.cpu_lion_step`) in a single pass, in place.

    param, grad: fp32 contiguous CPU tensors of n elements; exp_avg: fp32 or bf16, n elements;
    param_copy and grad_scale as in :func:`cpu_adam_step`.
    """
    args = (lr, beta1, beta2, weight_decay, grad_scale)
    path = cpu_path()
    if path == "reference":
        return reference.cpu_lion_step(param, grad, exp_avg, param_copy, *args)
    torch.ops.lightning_zero.cpu_lion_step(param, grad, exp_avg, param_copy, *args, path)


def cpu_sum_squares(x: Tensor) -> Tensor:
    """Sum of squares of a contiguous CPU tensor as a 0-dim fp32 tensor (fp64 for fp64 input): the
    host part of a gradient norm. fp32 and bf16 go to the compiled kernel (one read, bf16 widened
    in registers; csrc/cpu/kernels_impl_norm.h), whose order of additions is fixed by the ISA
    path alone, not by the thread count; other dtypes and the reference path take
    :func:`lightning_zero.ops.reference.cpu_sum_squares`. On one path a bf16 tensor and its fp32
    cast give the same value, bit for bit."""
    path = cpu_path() if x.dtype in (torch.float32, torch.bfloat16) else "reference"
    if path == "reference":
        return reference.cpu_sum_squares(x)
    return torch.ops.lightning_zero.cpu_sum_squares(x.contiguous(), path)


def _impl(name: str, device: torch.device):
    return getattr(reference if fused_path(device) == "reference" else torch.ops.lightning_zero, name)


def fused_adam_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: Tensor | None = None,
    param_copies: Sequence[Tensor] = (),
) -> None:
    """Multi-tensor Adam/AdamW over lists on one device, in place.

    params, exp_avgs, exp_avg_sqs: fp32; grads: fp32, bf16 or fp16 on CUDA (fp32 on CPU);
    param_copies: empty, or one bf16/fp16 tensor per param; grad_scale: optional one-element fp32
    tensor on the params' device (read on the device: no host synchronisation).
    """
    if not params:
        return
    _impl("fused_adam_step", params[0].device)(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(param_copies),
        grad_scale,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        adamw_mode,
        bias_correction,
    )


def fused_lamb_moments(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool = True,
    grad_scale: Tensor | None = None,
) -> Tensor:
    """Multi-tensor LAMB phase 1: fp32 (len(params), 2) squared norms, one row per tensor."""
    return _impl("fused_lamb_moments", params[0].device)(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        grad_scale,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        bias_correction,
    )


def fused_lamb_apply(
    params: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    trust_ratio: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool = True,
    param_copies: Sequence[Tensor] = (),
) -> None:
    """Multi-tensor LAMB phase 2; trust_ratio: fp32 (len(params),) on the params' device."""
    _impl("fused_lamb_apply", params[0].device)(
        list(params),
        list(exp_avgs),
        list(exp_avg_sqs),
        trust_ratio,
        list(param_copies),
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        bias_correction,
    )
