"""Optimizers and learning-rate schedules of the recipes, chosen by one config object.

- AdamW (``torch.optim.AdamW``) with linear warmup and cosine decay: GPT-2, as nanoGPT and GPT-3.
- LAMB (``lightning_zero.ops``: ``FusedLamb`` on CUDA, ``CPULamb`` on the CPU) with warmup and
  polynomial decay: BERT, as in NVIDIA's large-batch BERT records (arXiv 1904.00962).

Weight decay applies to matrices and embeddings (parameters of 2 or more dimensions), never to
biases or LayerNorm weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule. Steps are optimizer steps (after gradient accumulation)."""

    name: Literal["adamw", "lamb"] = "adamw"
    """``adamw`` (torch) or ``lamb`` (lightning_zero.ops, compiled)."""
    lr: float = 6e-4
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = 0.1
    """Decoupled weight decay on parameters of 2+ dimensions."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam/LAMB moment coefficients."""
    eps: float = 1e-8
    """Adam/LAMB denominator epsilon."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr``."""
    schedule: Literal["cosine", "poly", "constant"] = "cosine"
    """Decay after warmup, down to ``min_lr_ratio * lr`` at the last step."""
    decay_power: float = 1.0
    """Exponent of the ``poly`` schedule (BERT/LAMB records use 0.5; 1.0 is linear)."""
    min_lr_ratio: float = 0.1
    """Floor of the decay, as a fraction of ``lr``."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ValueError(
                f"OptimizerConfig: lr({self.lr}) and eps({self.eps}) must be > 0, "
                f"weight_decay({self.weight_decay}) >= 0"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas {self.betas} must lie in [0, 1)")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0 or self.decay_power <= 0:
            raise ValueError(
                f"OptimizerConfig: warmup_steps({self.warmup_steps}) >= 0, min_lr_ratio({self.min_lr_ratio}) "
                f"in [0, 1] and decay_power({self.decay_power}) > 0 are required"
            )


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: parameters of 2+ dimensions with ``weight_decay``, the others (biases, norms) without."""
    params = [p for p in module.parameters() if p.requires_grad]  # tied weights appear once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _lamb_class(device: torch.device) -> type[torch.optim.Optimizer]:
    name = "FusedLamb" if device.type == "cuda" else "CPULamb"
    try:
        from lightning_zero import ops

        return getattr(ops, name)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"optimizer 'lamb' needs lightning_zero.ops.{name}, which this installation lacks ({err}); "
            "rebuild the package (`pip install --no-build-isolation -e .`) or set optimizer.name: adamw"
        ) from err


def build_optimizer(config: OptimizerConfig, module: nn.Module) -> torch.optim.Optimizer:
    """The optimizer named by ``config`` over ``module``'s trainable parameters."""
    groups = param_groups(module, config.weight_decay)
    kwargs = {"lr": config.lr, "betas": config.betas, "eps": config.eps}
    if config.name == "adamw":
        return torch.optim.AdamW(groups, **kwargs)
    if config.name == "lamb":
        device = next(module.parameters()).device
        return _lamb_class(device)(groups, **kwargs)
    raise ValueError(f"optimizer name {config.name!r} is unknown; choose 'adamw' or 'lamb'")


def lr_multiplier(config: OptimizerConfig, total_steps: int) -> Callable[[int], float]:
    """The factor on ``lr`` at each optimizer step (for ``LambdaLR``): warmup, then the chosen decay."""
    if total_steps < 1:
        raise ValueError(f"the schedule needs the number of steps; got {total_steps}: set trainer.max_steps")

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
        if config.schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif config.schedule == "poly":
            decay = (1.0 - progress) ** config.decay_power
        else:
            decay = 1.0
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay

    return factor


def configure(config: OptimizerConfig, module: nn.Module, total_steps: int) -> dict:
    """What ``LightningModule.configure_optimizers`` returns: the optimizer and a per-step scheduler."""
    optimizer = build_optimizer(config, module)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config, total_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
