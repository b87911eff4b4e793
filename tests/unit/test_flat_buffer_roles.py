"""A flat buffer's roles and states change only through its methods: other modules (the disk tiers,
the sharded optimizer) read them, and ask the buffer for each transition."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from lightning_zero.zero.flat import FlatBuffer, GradState, ParamState, PendingGrad
from lightning_zero.zero.partition import layout_flat_buffer

ROLES = (
    "param_shard",
    "flat_param",
    "master",
    "grad_shard",
    "grad_bucket",
    "host_grad",
    "state",
    "grad_state",
    "shard_tier",
    "grad_tier",
    "pending_grad",
)


def _buffer(persistent: bool) -> tuple[FlatBuffer, list[nn.Parameter]]:
    """Rank 1 of 2 of an odd-shaped fp32 buffer (no separate master: the master is the shard)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 15)), nn.Parameter(torch.randn(5))]
    layout = layout_flat_buffer([p.shape for p in params], 2)
    b = FlatBuffer(
        params,
        layout,
        rank=1,
        optimizer_group=0,
        dtype=torch.float32,
        device=torch.device("cpu"),
        separate_master=False,
        persistent=persistent,
    )
    return b, params


class _Tier:
    """Records what the buffer asks of a tier (both protocols' methods that these tests reach)."""

    def pending(self, b: FlatBuffer, inv_scale: float) -> PendingGrad:
        return PendingGrad(inv_scale, None, zero=True)

    def rewrite(self, buffers: list[FlatBuffer]) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.mark.parametrize("persistent", [True, False])
def test_roles_are_read_only(persistent):
    b, _ = _buffer(persistent)
    for role in ROLES:
        with pytest.raises(AttributeError):
            setattr(b, role, None)


def test_split_master_gives_the_shard_its_own_storage():
    b, _ = _buffer(persistent=False)
    assert b.master is b.param_shard  # fp32 without a separate master
    before = b.param_shard.clone()
    assert b.split_master()
    assert b.master is not b.param_shard
    assert b.param_shard.untyped_storage().data_ptr() != b.master.untyped_storage().data_ptr()
    assert torch.equal(b.param_shard, before) and torch.equal(b.master, before)
    assert not b.split_master()  # already apart


def test_shard_tier_attach_and_detach():
    b, params = _buffer(persistent=False)
    assert b.state is ParamState.RELEASED
    assert any(p.numel() for p in params)  # released: views of this rank's pieces
    tier = _Tier()
    b.attach_shard_tier(tier)
    assert b.shard_tier is tier
    assert all(p.numel() == 0 for p in params)  # the shard is about to lose its memory
    b.detach_shard_tier()
    assert b.shard_tier is None
    persistent, _ = _buffer(persistent=True)
    with pytest.raises(AssertionError):
        persistent.attach_shard_tier(tier)


def test_pending_grad_only_under_a_grad_tier():
    b, _ = _buffer(persistent=False)
    with pytest.raises(AssertionError):
        b.defer_grad(0.5)  # no tier to leave the gradient in
    tier = _Tier()
    b.attach_grad_tier(tier)
    assert b.grad_tier is tier and b.grad_state is GradState.EMPTY
    b.defer_grad(0.5)
    assert b.pending_grad == PendingGrad(0.5, None, zero=True)
    b.drop_pending_grad()
    assert b.pending_grad is None
    b.defer_grad(1.0)
    b.detach_grad_tier()
    assert b.grad_tier is None and b.pending_grad is None
