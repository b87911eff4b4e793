"""lightning_zero.memory.ActivationMeter and MemoryMonitor: what autograd saves for backward,
counted exactly on a model whose saved tensors are known, parameters excluded."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_zero import MemoryMonitor, memory
from lightning_zero.memory import ActivationMeter, resident_bytes


def test_activation_meter_counts_saved_tensors_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    x = torch.randn(5, 7)
    meter = ActivationMeter()
    meter.start()
    loss = model(x).square().sum()
    saved = meter.stop(model)
    # Saved for backward: the input x (Linear 1 needs it for the weight gradient), tanh's output
    # (its own backward, and Linear 2's input: one storage), and the output of Linear 2 (square);
    # the weights are parameters (model states, not activations). fp32 = 4 bytes.
    assert saved == 4 * (5 * 7 + 5 * 13 + 5 * 3)
    loss.backward()  # the meter keeps nothing alive past stop()
    assert meter.peak == saved and meter.stop() == 0


def test_resident_bytes_reads_the_os():
    os_view = resident_bytes()
    assert 0 < os_view["resident"] <= os_view["peak_resident"]


def test_memory_monitor_rejects_bad_interval():
    with pytest.raises(ValueError, match="every_n_steps=0"):
        MemoryMonitor(every_n_steps=0)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(9, 11)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).tanh().sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_memory_monitor_on_one_process(quiet_trainer):
    monitor = MemoryMonitor()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 9)), batch_size=4)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[monitor],
    )
    trainer.fit(_Tiny(), data)
    last = monitor.last
    # input (4x9) and tanh's output (4x11), fp32; parameters and their gradients: (9*11 + 11) x 2
    assert last["activations"] == 4 * (4 * 9 + 4 * 11)
    assert last["model_states"] == 4 * 2 * (9 * 11 + 11) and last["pool"] == 0
    # what the OS adds (freed heap memory glibc keeps, library pages touched): measured, >= 0
    assert last["allocator"] >= 0 and last["mapped_files"] >= 0 and "resident" in last
    assert last["accounted"] == sum(last[k] for k in ("model_states", "activations", "allocator", "mapped_files"))
    assert last["other"] == last["peak_growth"] - last["accounted"]


@pytest.mark.skipif(memory.heap_free_bytes() is None, reason="not glibc >= 2.33 (mallinfo2)")
def test_heap_free_bytes_sees_holes_the_program_freed():
    # 64 KiB blocks are below glibc's mmap threshold: they come from the heap, and freeing every
    # other one leaves 32 holes (2 MiB) that glibc keeps free between the blocks still alive
    blocks = [torch.empty(16384) for _ in range(64)]
    before = memory.heap_free_bytes()
    del blocks[::2]
    assert memory.heap_free_bytes() - before >= 1 << 20


@pytest.mark.skipif(memory.heap_free_bytes() is None, reason="not glibc >= 2.33 (mallinfo2)")
def test_trim_heap_returns_freed_holes_to_the_os():
    # 512 x 64 KiB touched blocks from the heap; every other one freed leaves 16 MiB of whole free
    # pages between live blocks, resident until trimmed (what a model's parameters leave behind
    # once the engine has copied them into its flat buffers)
    blocks = [torch.ones(16384) for _ in range(512)]
    del blocks[::2]
    before = resident_bytes()["resident"]
    assert memory.trim_heap()
    assert before - resident_bytes()["resident"] >= 8 << 20
