"""Fake (meta) kernels: shapes and dtypes of each op's outputs, for torch.compile and FakeTensor.

The ops return nothing but the LAMB moments ops, whose result is fp32 (segments, 2), and the sum of
squares (a 0-dim fp32 tensor).
"""

from __future__ import annotations

import torch


def _none(*args, **kwargs) -> None:
    return None


def register() -> None:
    """Register the fake kernels; called once, when the ops have been loaded (:func:`lightning_zero.ops.compiled`)."""
    for name in (
        "cpu_adam_step",
        "cpu_lamb_apply",
        "cpu_adagrad_step",
        "cpu_lion_step",
        "fused_adam_step",
        "fused_lamb_apply",
    ):
        torch.library.register_fake(f"lightning_zero::{name}", _none)

    @torch.library.register_fake("lightning_zero::cpu_sum_squares")
    def _(x, isa):
        return x.new_empty((), dtype=torch.float32)

    @torch.library.register_fake("lightning_zero::cpu_lamb_moments")
    def _(param, grad, exp_avg, exp_avg_sq, segment_offsets, *args):
        return param.new_empty((segment_offsets.shape[0] - 1, 2), dtype=torch.float32)

    @torch.library.register_fake("lightning_zero::fused_lamb_moments")
    def _(params, grads, exp_avgs, exp_avg_sqs, *args):
        return params[0].new_empty((len(params), 2), dtype=torch.float32)
