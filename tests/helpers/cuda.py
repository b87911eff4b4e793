"""The model and Trainer of the GPU tests (tests/gpu): one CUDA device, world size 1 over NCCL.

:func:`odd_network` is an encoder, a body (Linear, LayerNorm, GELU, bias-free Linear), a decoder and
a head with odd widths, so that buckets and blocks cut through parameters, optionally with the decoder
tied to the encoder (a weight used twice per forward). :class:`Regression` trains any network on an
MSE loss with AdamW; :func:`fit_cuda` runs 6 steps of it under a strategy on 24 random rows and
returns the losses and the final state on the host, for a comparison with a reference run.

Importing this module sets ``CUBLAS_WORKSPACE_CONFIG`` (deterministic cuBLAS), which must happen
before CUDA starts: the GPU test modules import it at the top.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.trainer import quiet_trainer

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (set before CUDA starts)


class _EncodeDecode(nn.Module):
    def __init__(self, inputs: int, width: int, hidden: int, outputs: int, tied: bool, squash: bool) -> None:
        super().__init__()
        self.enc = nn.Linear(inputs, width)
        body = [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, width, bias=False)]
        self.net = nn.Sequential(*body, *([nn.Tanh()] if squash else []))
        self.dec = nn.Linear(width, inputs, bias=False)
        if tied:
            self.dec.weight = self.enc.weight
        self.head = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dec(self.net(self.enc(x))))


def odd_network(
    inputs: int, width: int, hidden: int, outputs: int, tied: bool = False, squash: bool = False
) -> nn.Module:
    """``head(dec(net(enc(x))))``: ``inputs -> width -> hidden -> width -> inputs -> outputs``; ``tied``
    shares the encoder's weight with the decoder (needs ``inputs == width``); ``squash`` ends the body
    with a tanh."""
    if tied and inputs != width:
        raise ValueError(f"a tied decoder needs inputs == width, got {inputs} and {width}")
    return _EncodeDecode(inputs, width, hidden, outputs, tied, squash)


class Regression(pl.LightningModule):
    """``network`` trained on the MSE to the targets (computed in fp32) with AdamW (lr 1e-2, weight
    decay 0.1); the loss of every step in ``losses``."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.network(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def fit_cuda(
    build: Callable[[], nn.Module],
    strategy: Any,
    precision: str,
    shape: tuple[int, int],
    seed: int = 11,
    clip: float | None = 0.5,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Seed, ``build()`` the network, train :class:`Regression` of it for 6 steps of 4 rows on one
    CUDA device (deterministic algorithms) under ``strategy``; ``shape``: the (inputs, targets)
    widths of the 24 random rows. Returns the step losses and the final state, fp32 on the host."""
    pl.seed_everything(seed, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, shape[0], generator=g), torch.randn(24, shape[1], generator=g))
    model = Regression(build())
    trainer = quiet_trainer(
        accelerator="cuda",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=6,
        gradient_clip_val=clip,
        deterministic=True,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model.losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
