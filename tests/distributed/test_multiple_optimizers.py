"""Two optimizers under manual optimization (a GAN: generator and discriminator) at ZeRO stages 1-3,
against Lightning's DDP on 2 gloo ranks.

The hazard: the generator's loss backpropagates through the discriminator, so the discriminator's
parameters receive gradients in the generator's window, as under DDP; the next ``opt_d.zero_grad()``
must drop them (ZeRO holds them in its buckets, not in ``param.grad``). No ``toggle_optimizer``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_zero.testing import run_ranks
from tests.helpers.parity import max_rel
from tests.helpers.workers import gan_worker

pytestmark = pytest.mark.distributed

ZERO3 = {"stage": 3, "param_persistence_threshold": 10, "prefetch_bucket_size": 200, "reduce_bucket_size": 40}


def test_two_optimizers_manual_match_ddp():
    specs = [
        ("ddp", "ddp"),
        ("zero1", {"stage": 1, "reduce_bucket_size": 40}),
        ("zero2", {"stage": 2, "reduce_bucket_size": 40}),
        ("zero3", ZERO3),
    ]
    for res in run_ranks(gan_worker, specs):
        ref = res["ddp"]
        assert len(ref["losses"]) == 4
        for name in ("zero1", "zero2", "zero3"):
            assert len(res[name]["losses"]) == 4
            # fp32: the only differences are summation order (reduce-scatter of flat buckets vs DDP's
            # all-reduce): ~1e-7 relative per step, amplified by a few Adam steps; 1e-5 is the bound
            # of the single-optimizer parity tests (test_parity.py).
            torch.testing.assert_close(
                torch.tensor(res[name]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0
            )
            for key, value in ref["state"].items():
                assert max_rel(res[name]["state"][key], value) <= 1e-5, (name, key)
