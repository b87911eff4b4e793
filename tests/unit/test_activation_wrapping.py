"""Activation checkpointing in one process: the wrapping itself (both paths: inputs kept where they
are, and inputs handed to the checkpoint as host copies), its removal, and the option checks.

Tolerance: none (exact). The recompute runs the same CPU kernels on the same inputs in the same
order, so gradients are bitwise those of the plain run; any difference is a wrapping bug.
The host-copy path runs here with host = CPU = the model's device, so ``.to`` copies nothing: this
checks that the path passes arguments, keyword arguments and gradients through; the memory it
saves only shows on an accelerator.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.activations import apply_activation_checkpointing, remove_activation_checkpointing
from lightning_zero.config import ActivationCheckpointConfig


class Block(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(15, 7), nn.Linear(7, 15), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        Block.calls += 1
        return x + scale * self.drop(self.down(torch.tanh(self.up(x))))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(3)  # the dropout masks
    y = x
    for block in model:
        y = block(y, scale=0.5)
    y.square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("offload", [False, True])
def test_checkpointed_gradients_equal_plain_ones(offload: bool):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), Block())
    x = torch.randn(5, 9, 15)
    plain = _grads(model, x)
    config = ActivationCheckpointConfig(policy=lambda m: isinstance(m, Block), offload=offload)
    assert apply_activation_checkpointing(model, config, torch.device("cpu")) == ["0", "1", "2"]
    assert set(model.state_dict()) == {
        f"{i}.{n}" for i in range(3) for n in ("up.weight", "up.bias", "down.weight", "down.bias")
    }
    Block.calls = 0
    got = _grads(model, x)
    assert Block.calls == 6, "each block ran its forward again in backward"
    for a, b in zip(got, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remove_activation_checkpointing(model)
    Block.calls = 0
    _grads(model, x)
    assert Block.calls == 3 and "forward" not in model[0].__dict__


def test_nested_selection_wraps_the_outermost_only():
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3)), nn.Linear(3, 3))
    config = ActivationCheckpointConfig(policy=lambda m: isinstance(m, (nn.Sequential, nn.Linear)))
    assert apply_activation_checkpointing(model, config) == ["0", "1"]


def test_offload_without_policy_is_refused():
    with pytest.raises(ValueError, match="activation_checkpointing is None"):
        ActivationCheckpointConfig(offload=True)
    with pytest.raises(ValueError, match="True or False"):
        ActivationCheckpointConfig(policy=Block, offload="yes")
