"""Every invalid option fails at construction or setup with a ValueError naming the value and the fix;
named strategies get an OffloadPrecision with the Trainer's precision; LightningCLI YAML works."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lightning_zero
from lightning_zero import LossScaleConfig, OffloadPrecision, ZeroStrategy
from lightning_zero.zero.step import check_optimizer


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage": 0}, "strategy='ddp'"),
        ({"stage": 4}, "stage=4"),
        ({"stage": True}, "stage=True"),
        ({"param_persistence_threshold": -1}, "param_persistence_threshold=-1"),
        ({"prefetch_bucket_size": 0}, "prefetch_bucket_size=0"),
        ({"max_live_parameters": -2}, "max_live_parameters=-2"),
        ({"stage": "2"}, "stage='2'"),
        ({"reduce_bucket_size": 0}, "reduce_bucket_size=0"),
        ({"reduce_bucket_size": -5}, "reduce_bucket_size=-5"),
        ({"allgather_bucket_size": 0}, "allgather_bucket_size=0"),
        ({"allgather_bucket_size": 2.5}, "allgather_bucket_size=2.5"),
        ({"loss_scale": None, "stage": -1}, "stage=-1"),
    ],
)
def test_invalid_strategy_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"initial_scale": 0}, "initial_scale=0"),
        ({"growth_factor": 1.0}, "growth_factor=1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor=1.5"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"min_scale": 10.0, "initial_scale": 2.0}, "min_scale=10.0"),
    ],
)
def test_invalid_loss_scale(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


@pytest.mark.parametrize("precision", ["16-true", "transformer-engine", "8"])
def test_unknown_precision(precision):
    with pytest.raises(ValueError, match="is not supported by lightning_zero"):
        OffloadPrecision(precision)


def test_trainer_precision_unsupported():
    with pytest.raises(ValueError, match="'16-true'"):
        pl.Trainer(strategy="zero2", precision="16-true", accelerator="cpu", devices=2, logger=False)


class Lamb(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


class MyElementwise(torch.optim.SGD):
    pass


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "optimizer,match",
    [
        (lambda: Lamb(_params()), "Lamb computes its update from whole-tensor statistics"),
        (lambda: Shampoo(_params()), "set Shampoo.whole_tensor = True"),
        (lambda: Custom(_params()), "allow_untested_optimizer=True"),
    ],
)
def test_rejected_optimizers(optimizer, match):
    with pytest.raises(ValueError, match=match):
        check_optimizer(optimizer(), allow_untested=False)


class Shampoo(torch.optim.Optimizer):  # named like a whole-tensor optimizer, not declared
    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


class Custom(torch.optim.Optimizer):  # an optimizer of unknown arithmetic
    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})


def test_untested_optimizer_allowed_on_request():
    check_optimizer(Custom(_params()), allow_untested=True)
    check_optimizer(MyElementwise(_params(), lr=0.1), allow_untested=False)  # a subclass of an elementwise one
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop):
        check_optimizer(cls(_params(), lr=0.1), allow_untested=False)


@pytest.mark.parametrize("name,stage", [("zero1", 1), ("zero2", 2)])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "64-true"])
def test_named_strategy_gets_offload_precision(name, stage, precision):
    trainer = pl.Trainer(strategy=name, precision=precision, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.zero_config.stage == stage
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, OffloadPrecision) and plugin.precision == precision


def test_explicit_plugin_kept():
    trainer = pl.Trainer(
        strategy="zero2", plugins=[OffloadPrecision("16-mixed")], accelerator="cpu", devices=2, logger=False
    )
    assert trainer.strategy.precision_plugin.precision == "16-mixed"
    strategy = ZeroStrategy(stage=1, precision_plugin=OffloadPrecision("bf16-mixed"))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  precision: bf16-mixed\n"
        "  logger: false\n"
        "  strategy:\n"
        "    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args: {stage: 1, reduce_bucket_size: 1000}\n"
    )
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.zero_config.stage == 1 and strategy.zero_config.reduce_bucket_size == 1000
    assert strategy.precision_plugin.precision == "bf16-mixed"


def test_public_names():
    assert {"ZeroStrategy", "OffloadPrecision"} <= set(lightning_zero.__all__)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: OffloadPrecision("bf16-true", offload_optimizer=True), "bf16-mixed"),
        (lambda: OffloadPrecision("bf16-mixed", offload_parameters=True), "offload_optimizer=True"),
        (lambda: ZeroStrategy(stage=2, offload_optimizer=True, offload_parameters=True), "stage=3"),
        (lambda: ZeroStrategy(on_nonfinite="maybe"), "on_nonfinite='maybe'"),
        (lambda: ZeroStrategy(absorb_param_edits="yes"), "absorb_param_edits='yes'"),
        (lambda: ZeroStrategy(pin_memory="yes"), "pin_memory='yes'"),
        (lambda: OffloadPrecision("16-mixed", loss_scale=1024), "loss_scale=1024"),
    ],
)
def test_invalid_offload_and_nonfinite_options(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("name,stage,params", [("zero2_offload", 2, False), ("zero3_offload", 3, True)])
def test_offload_names(name, stage, params):
    trainer = pl.Trainer(strategy=name, precision="bf16-mixed", accelerator="cpu", devices=2, logger=False)
    offload = trainer.strategy.precision_plugin.offload
    assert trainer.strategy.zero_config.stage == stage
    assert offload.offload_optimizer and offload.offload_parameters == params


def test_loss_scaler_state_round_trip():
    plugin = OffloadPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=1024.0, growth_interval=2))
    for overflow in (True, False, False, False):
        plugin.scaler.update(overflow)
    # 1024 -> 512 on the overflow, x2 after two good steps, one more good step pending
    assert plugin.scaler.scale == 1024.0 and plugin.scaler.good_steps == 1
    restored = OffloadPrecision("16-mixed")
    restored.load_state_dict(plugin.state_dict())
    assert restored.scaler.state_dict() == plugin.scaler.state_dict()


def test_auto_bucket_sizes_follow_the_model():
    from lightning_zero.config import ZeroConfig

    assert ZeroConfig(stage=3).reduce_bucket_size == "auto"
    assert ZeroConfig(stage=3).prefetch_bucket_size == 5_000_000  # auto only on request: see its docstring
    auto = ZeroConfig(stage=3, prefetch_bucket_size="auto")
    small = auto.sized_for(13_800_001)  # the benchmark GPT: a sixteenth of it
    assert small.reduce_bucket_size == small.prefetch_bucket_size == 862_500
    assert auto.sized_for(1000).reduce_bucket_size == 1 << 18  # floor: tiny models do not get tiny buckets
    assert auto.sized_for(10**9).prefetch_bucket_size == 5_000_000  # DeepSpeed's default from 80M on
    explicit = ZeroConfig(stage=3, reduce_bucket_size=123, prefetch_bucket_size=456).sized_for(10**6)
    assert (explicit.reduce_bucket_size, explicit.prefetch_bucket_size) == (123, 456)  # the user's choice stays
    with pytest.raises(ValueError, match='or "auto"'):
        ZeroConfig(reduce_bucket_size="large")
    with pytest.raises(ValueError, match=r"allgather_bucket_size='auto' must be a positive number of elements \(e"):
        ZeroConfig(allgather_bucket_size="auto")  # type: ignore[arg-type]  # only the two sized options take it


def test_strategy_resolves_auto_sizes_for_its_model(quiet_trainer):
    from torch.utils.data import DataLoader, TensorDataset

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(700, 900), torch.nn.Linear(900, 3))

        def training_step(self, batch, batch_idx):
            return self.layers(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    strategy = ZeroStrategy(stage=2)
    assert strategy.zero_config.reduce_bucket_size == "auto"
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
    )
    model = Model()
    numel = sum(p.numel() for p in model.parameters())  # 633,603: a sixteenth is 39,600, under the floor
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(4, 700)), batch_size=2))
    assert strategy.zero_config.reduce_bucket_size == max(1 << 18, numel // 16) == 1 << 18
    sizes = [b.layout.numel for b in strategy._engine._buffers]
    # the 630,000-element weight is a bucket of its own; the rest share one of at most 262,144
    assert sorted(sizes) == [3 + 900 + 2700, 630_000], sizes
