"""The ZeRO engine: builds the flat buffers of every optimizer of a model and drives the data path
(partition -> reduce -> step -> publish) for stages 1 and 2.

The strategy calls, per optimizer step::

    [backward]              reducer hooks fill buckets and reduce-scatter them
    finish_backward()       after every backward: remaining reductions complete
    prepare_step(opt)       reduced slices become master.grad (unscaled)
    clip_grad_norm(opt, c)  optional, from Lightning's gradient clipping
    step(opt)               optimizer on the slices, then all-gather the updated slices
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import ZeroConfig
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.gather import publish
from lightning_zero.zero.optimizer import ShardedOptimizer, check_optimizer
from lightning_zero.zero.partition import layout_flat_buffer, plan_buckets
from lightning_zero.zero.reduce import GradReducer

_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # Lightning hands hooks a LightningOptimizer wrapper; the engine keys on the wrapped optimizer.
    return getattr(optimizer, "_optimizer", optimizer)


class ZeroEngine:
    """Flat buffers, gradient reduction and sharded steps for ``optimizers`` of ``module``.

    Args:
        module: the model; its parameters become views into flat buffers of ``compute_dtype``.
        optimizers: the optimizers from ``configure_optimizers``; rewired in place to master slices.
        config: the ZeRO options.
        compute_dtype: dtype of parameters and gradients (fp32, bf16 or fp16).
        separate_master: keep an fp32 master slice (mixed precision) instead of stepping the parameters.
        group: the data-parallel process group (``None``: the default group).
        device: where flat buffers live.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        config: ZeroConfig,
        compute_dtype: torch.dtype,
        separate_master: bool,
        group: comm.ProcessGroup,
        device: torch.device,
    ) -> None:
        for optimizer in optimizers:
            check_optimizer(_unwrap(optimizer), config.allow_untested_optimizer)
        self.config = config
        self.group = group
        self.device = device
        self.world_size = comm.world_size(group)
        self.rank = comm.rank(group)
        # Every rank starts from rank 0's weights, as DDP does when it wraps a module.
        comm.broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), group)

        self.sharded: dict[int, ShardedOptimizer] = {}
        self.buffers: list[FlatBuffer] = []
        seen: set[int] = set()
        for optimizer in map(_unwrap, optimizers):
            buffers = self._build_buffers(optimizer, seen, compute_dtype, separate_master)
            self.buffers.extend(buffers)
            self.sharded[id(optimizer)] = ShardedOptimizer(optimizer, buffers, group)
        self.reducer = GradReducer(self.buffers, config.stage, group, device, config.overlap_comm)
        self._norms: dict[int, torch.Tensor] = {}

        orphans = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
        if orphans:
            warnings.warn(
                f"{len(orphans)} trainable parameters are in no optimizer (e.g. {orphans[:3]}); ZeRO neither "
                "reduces nor updates them. Freeze them (requires_grad=False) or add them to an optimizer.",
                stacklevel=2,
            )

    def _build_buffers(
        self, optimizer: torch.optim.Optimizer, seen: set[int], dtype: torch.dtype, separate_master: bool
    ) -> list[FlatBuffer]:
        buffers = []
        for g_index, param_group in enumerate(optimizer.param_groups):
            # Autograd produces gradients roughly in reverse registration order: bucket that way.
            params = [p for p in reversed(param_group["params"]) if p.requires_grad]
            for param in params:
                if id(param) in seen:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} appears in two optimizers or parameter groups; "
                        "give each parameter to exactly one."
                    )
                if param.dtype not in _SUPPORTED_PARAM_DTYPES:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} has dtype {param.dtype}; ZeRO supports "
                        f"{[str(d) for d in _SUPPORTED_PARAM_DTYPES]}. Convert the model or freeze the parameter."
                    )
                seen.add(id(param))
            for run in plan_buckets([p.numel() for p in params], self.config.reduce_bucket_size):
                run_params = [params[i] for i in run]
                layout = layout_flat_buffer([p.shape for p in run_params], self.world_size)
                buffers.append(
                    FlatBuffer(run_params, layout, self.rank, g_index, dtype, self.device, separate_master)
                )
        return buffers

    # -- per micro-step -----------------------------------------------------------------------

    def no_sync(self):
        """Context for micro-steps before the accumulation boundary."""
        return self.reducer.no_sync()

    def finish_backward(self) -> None:
        """Complete this backward's reductions. Call on all ranks after every backward."""
        self.reducer.finish()

    # -- per optimizer step -------------------------------------------------------------------

    def _get(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        return self.sharded[id(_unwrap(optimizer))]

    def prepare_step(self, optimizer: torch.optim.Optimizer, inv_scale: float = 1.0) -> None:
        """Expose the reduced gradient slices, unscaled, as ``master.grad``."""
        self._norms.pop(id(_unwrap(optimizer)), None)
        self._get(optimizer).prepare(inv_scale)

    def grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Global gradient L2 norm over all ranks. Call on all ranks."""
        key = id(_unwrap(optimizer))
        if key not in self._norms:
            self._norms[key] = self._get(optimizer).grad_norm()
        return self._norms[key]

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip to a global norm of ``max_norm``; returns the norm before clipping. Call on all ranks."""
        # No isfinite() check here: it would synchronize the host. A non-finite norm makes the
        # coefficient 0 or NaN, and "16-mixed" skips such a step anyway (as torch's clip_grad_norm_).
        norm = self.grad_norm(optimizer)
        self._get(optimizer).clip_grad_norm(max_norm, norm)
        return norm

    def clip_grad_value(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        self._get(optimizer).clip_grad_value(clip_value)

    def step(self, optimizer: torch.optim.Optimizer, check_overflow: bool = False) -> bool:
        """Step this rank's slices and publish them; returns True when skipped for non-finite
        gradients (only checked with ``check_overflow``, for loss-scaled fp16). Call on all ranks."""
        sharded = self._get(optimizer)
        overflow = check_overflow and not bool(torch.isfinite(self.grad_norm(optimizer)))
        if not overflow:
            sharded.step()
            publish(sharded.buffers, self.group, self.config.allgather_bucket_size)
        self.skip_step(optimizer)
        return overflow

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step's gradients without updating anything."""
        sharded = self._get(optimizer)
        sharded.release_grads()
        self.reducer.zero_grad(sharded.buffers)
        self._norms.pop(id(_unwrap(optimizer)), None)

    # -- checkpoints and teardown ---------------------------------------------------------------

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Consolidated (unsharded) state on rank 0, ``{}`` elsewhere. Call on all ranks."""
        return self._get(optimizer).consolidated_state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self._get(optimizer).load_consolidated_state_dict(state_dict)

    def find(self, optimizer: torch.optim.Optimizer) -> Optional[ShardedOptimizer]:
        return self.sharded.get(id(_unwrap(optimizer)))

    def close(self) -> None:
        """Remove the gradient hooks (the parameters stay views of the flat buffers)."""
        self.reducer.remove_hooks()
