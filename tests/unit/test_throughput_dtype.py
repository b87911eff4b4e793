"""Lightning's stock ThroughputMonitor measures FLOP/s and MFU against the peak of the dtype the run
computes in. It looks the dtype up by the class of the precision plugin and counts unknown
plugins as fp32; OffloadPrecision declares its dtype the way Lightning's HalfPrecision does."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.callbacks import throughput_monitor as monitor_module
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

import lightning_zero  # noqa: F401 - registers the strategy names
from lightning_zero import OffloadPrecision, ZeroStrategy

# A fake device whose peak differs per dtype, so the test sees which dtype the monitor asked for.
PEAKS = {torch.float64: 1e11, torch.float32: 1e12, torch.float16: 4e12, torch.bfloat16: 8e12}
EXPECTED = {
    "32-true": torch.float32,
    "64-true": torch.float64,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
}


def _monitor_flops(trainer: pl.Trainer, monkeypatch: pytest.MonkeyPatch) -> tuple[list, ThroughputMonitor]:
    asked: list = []

    def fake_peak(device: torch.device, dtype: torch.dtype) -> float:
        asked.append(dtype)
        return PEAKS[dtype]

    monkeypatch.setattr(monitor_module, "get_available_flops", fake_peak)
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: 1)
    trainer.state.fn = TrainerFn.FITTING
    trainer.state.stage = RunningStage.TRAINING
    monitor.setup(trainer, BoringModel(), TrainerFn.FITTING)
    return asked, monitor


# Offload steps fp32 masters on the CPU, so it takes neither "64-true" nor "bf16-true" (a ValueError,
# tested in test_options.py). "16-mixed" by name is left out because on a CPU Lightning's connector
# turns the string into "bf16-mixed" before the strategy sees it; the explicit plugin test covers fp16.
NAMED = [
    (name, precision)
    for name in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
    for precision in ("32-true", "64-true", "bf16-mixed", "bf16-true")
    if not (name.endswith("_offload") and precision in ("64-true", "bf16-true"))
]


@pytest.mark.parametrize("name,precision", NAMED)
def test_stock_monitor_uses_compute_dtype(name, precision, monkeypatch):
    trainer = pl.Trainer(strategy=name, precision=precision, accelerator="cpu", devices=2, logger=False)
    asked, monitor = _monitor_flops(trainer, monkeypatch)
    assert asked == [EXPECTED[precision]]
    assert monitor.available_flops == PEAKS[EXPECTED[precision]]
    # the meters that turn FLOPs into MFU get the same peak
    assert {t.available_flops for t in monitor._throughputs.values()} == {PEAKS[EXPECTED[precision]]}


@pytest.mark.parametrize("precision", sorted(EXPECTED))
def test_explicit_plugin_dtype(precision, monkeypatch):
    strategy = ZeroStrategy(stage=3, precision_plugin=OffloadPrecision(precision))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    asked, _ = _monitor_flops(trainer, monkeypatch)
    assert asked == [EXPECTED[precision]]
