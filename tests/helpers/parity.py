"""Comparing a run with its reference: the two measures every parity test states its bounds in.

Why the tolerances of the suite are what they are (each test's comment names the case it is in):

* **fp32, same arithmetic** (ZeRO against DDP or one process with torch's optimizers): the runs
  differ only in summation order (a reduce-scatter sums the ranks' gradients in another order than
  DDP's all-reduce, buckets cut the flat buffers elsewhere) and in the optimizer's kernel (ours
  against torch's foreach AdamW: a few ulp per step, tests/unit/test_ops_adam.py). Over a handful
  of steps at lr 1e-2 that stays below 1e-5 relative, the bound the tests put on :func:`max_rel`;
  a wrong shard, a lost gradient or a step applied twice gives ~1e-2 or more.
* **bf16-mixed**: both sides compute under bf16 autocast, but ZeRO also stores parameters and
  gradients in bf16 where Lightning keeps them in fp32: one extra rounding of 2**-9 on every weight
  and gradient per step. Losses stay within ~3e-3, whole tensors within ~1.3e-2 measured by
  :func:`norm_rel` (element-wise, Adam can flip a near-zero element by 2 lr, so :func:`max_rel` is
  no use there); the tests allow 1e-2 on losses and 5e-2 on tensors, and a wrong mapping gives ~1.
* **the same kernels on the same inputs** (NVMe against CPU offload, pipelined against plain
  offload, a resume against the run it continues): equal bit for bit, compared with ``==`` /
  ``torch.equal``, never with a tolerance.

Both measures are relative to the reference tensor ``b`` (the DDP or one-process side), with a floor
of 1e-12 so that an all-zero reference (a frozen bias, an unused parameter) reads as an absolute
difference instead of dividing by zero.
"""

from __future__ import annotations

import torch


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest element-wise difference between ``a`` and the reference ``b``, relative to ``b``'s
    largest magnitude: for fp32 runs, where every element must agree."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The norm of ``a - b`` relative to the reference ``b``'s norm: for bf16 runs, where single
    elements may differ by a rounding step but the tensor as a whole must agree."""
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
