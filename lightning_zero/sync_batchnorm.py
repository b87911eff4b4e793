"""``Trainer(sync_batchnorm=True)`` under ZeRO: BatchNorm statistics over every data-parallel rank.

The Trainer strategy converts BatchNorm layers as Lightning's ``DDPStrategy`` does (at the start of
``fit``, back at its end), into :class:`SyncBatchNorm`: torch's ``nn.SyncBatchNorm`` on the devices
torch supports (CUDA, XPU, ...) and, on CPU, the same arithmetic through :mod:`lightning_zero.comm`
(torch's refuses CPU tensors, so CPU/gloo training, tests included, would otherwise fail in the
first forward). The layer keeps torch's class, state-dict keys and parameters, so checkpoints,
optimizers and stage 3's gathers see no difference. Fabric users convert their model themselves:
``model = lightning_zero.SyncBatchNorm.convert_sync_batchnorm(model)`` before ``fabric.setup``.

Cost on CPU: two all-reduces of ``2 * channels`` numbers in forward (the mean, then the variance,
two passes as torch's CPU BatchNorm for accuracy) and two in backward, per layer and micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch import nn

from lightning_zero import comm


class _SumOverRanks(torch.autograd.Function):
    """forward: all-reduce (sum) over ``group``; backward: all-reduce (sum) of the gradient, since every
    rank's loss depends on the global sum, so the sum's gradient is the sum of every rank's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: comm.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group, label="sync_batchnorm")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        comm.all_reduce(out, ctx.group, label="sync_batchnorm")
        return out, None


class SyncBatchNorm(nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` that also synchronizes CPU tensors (over gloo). Input ``(N, C, *)``;
    statistics over ``N`` and ``*`` of every rank of ``process_group`` (the world when ``None``)."""

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """torch's conversion of every ``BatchNorm*D`` layer of ``module``, into this class."""
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
        for sub in converted.modules():
            if type(sub) is nn.SyncBatchNorm:
                sub.__class__ = cls  # same state, parameters and keys: only forward differs
        return converted

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu" or not self.training or comm.world_size(self.process_group) == 1:
            return super().forward(input)  # torch's: its devices, evaluation, or nothing to synchronize
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        count = torch.tensor([input.numel() // channels], dtype=x.dtype)
        comm.all_reduce(count, self.process_group, label="sync_batchnorm")
        n = float(count.item())
        mean = _SumOverRanks.apply(x.sum(dims), self.process_group) / n
        centered = x - mean.view(shape)
        var = _SumOverRanks.apply((centered * centered).sum(dims), self.process_group) / n
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (n / max(n - 1.0, 1.0))  # running_var is unbiased, as torch's
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)


class ZeroSyncBatchNorm(TorchSyncBatchNorm):
    """Lightning's ``sync_batchnorm=True`` plugin, converting into :class:`SyncBatchNorm` (CPU too)."""

    def apply(self, model: nn.Module) -> nn.Module:
        return SyncBatchNorm.convert_sync_batchnorm(model)


def zero_layer_sync(layer_sync: LayerSync) -> LayerSync:
    """The Trainer's ``sync_batchnorm=True`` plugin as ZeRO applies it: Lightning's default
    (torch's SyncBatchNorm, which refuses CPU tensors) becomes :class:`ZeroSyncBatchNorm`; a user's
    own ``LayerSync`` plugin stays."""
    return ZeroSyncBatchNorm() if type(layer_sync) is TorchSyncBatchNorm else layer_sync
