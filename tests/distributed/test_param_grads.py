"""``expose_param_grads``: user code reading and editing ``param.grad`` where Lightning runs it gets
DDP's values, on 2 gloo ranks against Lightning's DDP, fp32.

* Automatic optimization, 2-batch accumulation windows: ``on_before_optimizer_step`` records
  Lightning's ``grad_norm(self, 2)`` utility and the ``.grad`` sums; ``configure_gradient_clipping``
  clamps ``p.grad`` in place (the edit must reach the step) and then clips the norm through Lightning
  (``self.clip_gradients``), at stages 1-3.
* Manual optimization, with the default ``expose_param_grads=None``: after each ``manual_backward``
  (two per step: the window accumulates) the ``.grad`` values, at stages 1 and 2 DDP's on every rank;
  at stage 3 a sharded parameter holds this rank's piece of the weight there and its ``.grad`` is the
  same piece of DDP's (the pieces of the two ranks add up to DDP's sum), a whole (small) one DDP's
  ``.grad``; with ``expose_param_grads=False`` ``.grad`` stays None (the opt-out).
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks
from tests.helpers.trainer import quiet_trainer

pytestmark = pytest.mark.distributed

ZERO3 = {"stage": 3, "param_persistence_threshold": 10, "reduce_bucket_size": 40}
SPECS = {
    "zero1": {"stage": 1, "reduce_bucket_size": 40},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
    "zero3": ZERO3,
}


class GradReader(pl.LightningModule):
    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 3))
        self.seen: list[dict[str, float]] = []

    def _loss(self, batch: Any) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return self._loss(batch)
        opt = self.optimizers()
        opt.zero_grad()
        for scale in (1.0, 0.5):  # two backwards: the second .grad is the sum so far, as DDP's
            self.manual_backward(self._loss(batch) * scale)
            self.seen.append(
                {
                    n: None if p.grad is None else (float(p.grad.sum()), p.grad.numel())
                    for n, p in self.named_parameters()
                }
            )
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.automatic_optimization:
            norms = grad_norm(self, norm_type=2)
            self.seen.append({k: float(v) for k, v in norms.items()})

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any) -> None:
        for p in self.parameters():
            p.grad.clamp_(-0.05, 0.05)  # an edit of .grad that the step must use
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


def _spec(name: str) -> dict:
    """``"zero2"`` -> its options with ``expose_param_grads=True`` (the automatic hooks need it);
    ``"zero2:default"`` / ``"zero2:off"``: the default (None) / False."""
    name, _, mode = name.partition(":")
    expose = {"": True, "default": None, "off": False}[mode]
    return {**SPECS[name], "expose_param_grads": expose}


def _worker(rank: int, manual: bool, names: list[str]) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    x = torch.randn(24, 15, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ["ddp", *names]:
        pl.seed_everything(7, verbose=False)
        model = GradReader(manual)
        strategy = DDPStrategy(find_unused_parameters=True) if name == "ddp" else ZeroStrategy(**_spec(name))
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_epochs=1,
            accumulate_grad_batches=1 if manual else 2,
            gradient_clip_val=None if manual else 0.1,
        )
        trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(x), batch_size=3))
        with trainer.strategy.gathered_parameters() if name != "ddp" else contextlib.nullcontext():
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[name] = {"seen": model.seen, "state": weights}
    return out


def _check(res: dict, names: list[str], count: int) -> None:
    ref = res["ddp"]
    assert len(ref["seen"]) == count
    for name in names:
        assert len(res[name]["seen"]) == count, name
        for got, want in zip(res[name]["seen"], ref["seen"], strict=True):
            assert set(got) == set(want)
            # fp32: summation order only (reduce-scatter of flat buckets vs DDP's all-reduce, a few
            # steps of SGD): the bound of the other parity tests, 1e-5 relative (abs 1e-6 near zero)
            for key, value in want.items():
                assert abs(got[key] - value) <= 1e-5 * abs(value) + 1e-6, (name, key, got[key], value)
        for key, value in ref["state"].items():
            torch.testing.assert_close(res[name]["state"][key], value, rtol=1e-5, atol=1e-6, msg=(name, key))


def test_grads_in_hooks_and_clipping_edits_match_ddp():
    names = ["zero1", "zero2", "zero3"]
    for res in run_ranks(_worker, False, names, timeout=600):
        _check(res, names, count=2)  # 4 batches per rank, windows of 2


def _close(got: float, want: float) -> bool:
    # fp32, summation order only: the bound of the other parity tests
    return abs(got - want) <= 1e-5 * abs(want) + 1e-6


def test_grads_after_manual_backward_match_ddp():
    names = ["zero1:default", "zero2:default", "zero3:default", "zero2:off"]
    ranks = run_ranks(_worker, True, names, timeout=600)
    for name in names:
        sharded = 0
        for seen in [r[name]["seen"] for r in ranks] + [r["ddp"]["seen"] for r in ranks]:
            assert len(seen) == 8, name  # 4 steps, two backwards each
        for step in range(8):
            want = ranks[0]["ddp"]["seen"][step]
            got = [r[name]["seen"][step] for r in ranks]
            assert all(set(g) == set(want) for g in got), name
            for key, (value, numel) in want.items():
                if name.endswith(":off"):
                    assert all(g[key] is None for g in got), (name, key)
                elif all(g[key][1] == numel for g in got):  # a whole gradient on every rank: DDP's
                    assert all(_close(g[key][0], value) for g in got), (name, step, key, got, value)
                else:  # stage 3, a sharded parameter: this rank's piece; the pieces make up DDP's
                    assert name.startswith("zero3"), (name, key)
                    assert sum(g[key][1] for g in got) == numel, (name, key)
                    assert _close(sum(g[key][0] for g in got), value), (name, step, key, got, value)
                    sharded += 1
        assert sharded > 0 if name.startswith("zero3") else sharded == 0, name  # (both weights are sharded)
        # the weights trained as under DDP (exposing is read-only)
        for key, value in ranks[0]["ddp"]["state"].items():
            torch.testing.assert_close(ranks[0][name]["state"][key], value, rtol=1e-5, atol=1e-6, msg=(name, key))
