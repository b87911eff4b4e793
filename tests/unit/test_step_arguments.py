"""What a user passes to ``optimizer.step(...)`` and what a user puts in place of an optimizer class's
``step`` reach the step under ZeRO as under plain torch / DDP (Lightning's
``test_step_with_optimizer_closure_with_different_frequencies`` passes ``opt.step(closure=..., optim="sgd")``
and mocks ``torch.optim.SGD.step`` / ``torch.optim.Adam.step`` on the class). One process, no process
group (every collective is the identity); odd shapes (15 -> 7 -> 3)."""

from __future__ import annotations

import importlib
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_zero.config import OffloadConfig, StrategyConfig, ZeroConfig
from lightning_zero.zero import step_kernels
from lightning_zero.zero.engine import ZeroEngine

CPU = torch.device("cpu")


class ScaledSGD(torch.optim.SGD):
    """An SGD whose ``step`` takes an extra keyword (as optimizers with custom step arguments do)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[tuple[float, float]] = []

    def step(self, closure: Any = None, lr_scale: float = 1.0) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.seen.append((float(loss) if loss is not None else float("nan"), lr_scale))
        for group in self.param_groups:
            group["lr"] *= lr_scale
        super().step()
        for group in self.param_groups:
            group["lr"] /= lr_scale
        return loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 3))


def _losses(model: nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine | None) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for step in range(3):
        loss = model(torch.randn(5, 15)).square().mean()
        loss.backward()
        losses.append(loss.item())
        kwargs = {"closure": lambda loss=loss: loss.detach(), "lr_scale": 0.5 + step}
        if engine is None:
            optimizer.step(**kwargs)
            optimizer.zero_grad()
        else:
            engine.backward_done()
            engine.step(optimizer, step_kwargs=kwargs)
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_keywords_and_closure_reach_the_optimizers_step(stage):
    reference = _model()
    ref_opt = ScaledSGD(reference.parameters(), lr=0.1)
    _losses(reference, ref_opt, None)

    model = _model()
    opt = ScaledSGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(
        model, [opt], config=StrategyConfig(zero=ZeroConfig(stage=stage)), precision="32-true", device=CPU
    )
    _losses(model, opt, engine)
    engine.close()
    # The closure handed on returns the loss the step's own closure computed; the keyword arrives.
    assert [s for _, s in opt.seen] == [0.5, 1.5, 2.5]
    assert [loss for loss, _ in opt.seen] == pytest.approx([loss for loss, _ in ref_opt.seen], rel=1e-6)
    # fp32 SGD on one rank: the same arithmetic on slices as on whole tensors (bit-equal in
    # practice); 1e-6 leaves room for the flat buffer's summation order.
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("patched_before_import", [False, True])
def test_a_patched_adam_step_runs_instead_of_the_kernel(offload, patched_before_import):
    original = torch.optim.Adam.step
    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    _losses_adam(reference, ref_opt, None)

    model = _model()
    with mock.patch.object(torch.optim.Adam, "step", autospec=True, side_effect=original) as patched:
        if patched_before_import:
            # The patch was in place when the package was imported (Lightning's tests patch the class
            # in a decorator and the strategy is imported inside the test): re-running the module
            # then must not take the patched step for torch's own.
            importlib.reload(step_kernels)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        config = StrategyConfig(
            zero=ZeroConfig(stage=2), offload=OffloadConfig(offload_optimizer=offload, pin_memory=False)
        )
        engine = ZeroEngine(model, [opt], config=config, precision="32-true", device=CPU)
        _losses_adam(model, opt, engine)
        engine.close()
    # The user's (here: patched) step ran once per optimizer step, with the closure handed on.
    assert patched.call_count == 3
    # torch's own Adam arithmetic on slices of fp32 masters: a few ulps from reduction order.
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def _losses_adam(model: nn.Module, optimizer: torch.optim.Optimizer, engine: ZeroEngine | None) -> None:
    torch.manual_seed(1)
    for _ in range(3):
        loss = model(torch.randn(5, 15)).square().mean()
        loss.backward()
        if engine is None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward_done()
            engine.step(optimizer, step_kwargs={"closure": lambda loss=loss: loss.detach()})
