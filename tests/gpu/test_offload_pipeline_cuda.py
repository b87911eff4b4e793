"""Pipelined ZeRO-Offload on a GPU: the 16-bit copy-back on a side stream.

Skipped (with the reason in the -ra summary) without a CUDA device. On a GPU the host kernel writes
each bucket's bf16 parameters into a pinned staging buffer; pipelined, its host-to-device copy runs
on a side stream and the bucket's all-gather waits for it on the device, while the host steps the
next bucket (lightning_zero/offload/copy_back.py). The results must equal the unpipelined path
bitwise (same kernels on the same slices; copies move bits). The forward and backward run with
deterministic algorithms so that the two runs' gradients are bitwise equal too.
"""

import os

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (set before CUDA starts)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none found"),
]


def test_copy_back_copies_on_a_side_stream_and_orders_the_compute_stream():
    from lightning_zero.offload.copy_back import CopyBack

    copy_back = CopyBack()
    host = torch.arange(278011, dtype=torch.float32).to(torch.bfloat16).pin_memory()
    device_slice = torch.zeros(278011, dtype=torch.bfloat16, device="cuda")
    device_slice.add_(1)  # queued work on the compute stream that the copy must follow
    event = copy_back.copy(device_slice, host)
    assert event is not None
    assert copy_back.streams[device_slice.device] != torch.cuda.current_stream()
    copy_back.end()
    out = device_slice.float().cpu()  # on the compute stream: after the side stream's copy
    assert torch.equal(out, host.float())
    copy_back.before_write(host)  # the host may rewrite the staging buffer now
    assert event.query() and not copy_back.pending


def _fit(pipeline: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # odd shapes: buckets of 40 elements cut through parameters
            self.net = nn.Sequential(nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    pl.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 15, generator=g), torch.randn(24, 3, generator=g))
    model = Model()
    strategy = ZeroStrategy(
        stage=2, offload_optimizer=True, reduce_bucket_size=40, allgather_bucket_size=100, offload_pipeline=pipeline
    )
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model.losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def test_pipelined_offload_is_bitwise_unpipelined_on_gpu():
    piped_losses, piped = _fit(pipeline=True)
    plain_losses, plain = _fit(pipeline=False)
    assert piped_losses == plain_losses  # bitwise: see the module docstring
    for key, value in plain.items():
        assert torch.equal(piped[key], value), key
