"""The Fabric side of the tests: a launched 2-rank CPU Fabric and a plain training loop over
:class:`~tests.helpers.models.ParityModel` (accumulation under ``no_backward_sync``, clipping by norm
or by value), shared by the Fabric parity, checkpoint and program tests."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from tests.helpers.models import VOCAB, ParityModel

#: micro-batches per optimizer step in :func:`train`
ACCUMULATE = 2


def loss_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of :class:`~tests.helpers.models.ParityModel` on ``tokens``."""
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_fabric(strategy: Any, precision: str = "32-true") -> Any:
    """A launched 2-rank CPU Fabric; ``"ddp"``: Fabric's DDP (unused-parameter search: the model has one)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    from lightning_zero.fabric import ZeroStrategy

    if strategy == "ddp":
        strategy = DDPStrategy(find_unused_parameters=True)
    elif isinstance(strategy, dict):
        strategy = ZeroStrategy(**strategy)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def train(fabric: Any, model: Any, optimizer: Any, scheduler: Any, loader: Any, clip: str, steps: int) -> list[float]:
    """``steps`` optimizer steps of ACCUMULATE micro-batches each; the micro-batch losses.
    ``optimizer``: one or a list (each clipped and stepped); ``scheduler``: one or None."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    losses: list[float] = []
    for index, (tokens,) in enumerate(loader):
        boundary = (index + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = loss_of(model, tokens)
            fabric.backward(loss / ACCUMULATE)
        losses.append(loss.item())
        if boundary:
            for opt in optimizers:
                if clip == "norm":
                    fabric.clip_gradients(model, opt, max_norm=0.5)
                elif clip == "value":
                    fabric.clip_gradients(model, opt, clip_val=0.02)
                opt.step()
                opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
        if len(losses) == steps * ACCUMULATE:
            break
    return losses


def weights(fabric: Any, model: ParityModel) -> dict[str, torch.Tensor]:
    """The whole model's state as fp32 copies (gathered first under stage 3)."""
    gathered = getattr(fabric.strategy, "gathered_parameters", None)
    with gathered(model) if gathered is not None else contextlib.nullcontext():
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}
