"""The ZeRO engine: builds the flat buffers of every optimizer of a model and drives the data path
(partition -> gather -> reduce -> step -> publish) for stages 1, 2 and 3.

The strategy calls, per optimizer step::

    [backward]              reducer hooks fill buckets and reduce-scatter them
    finish_backward()       after every backward: remaining reductions complete
    prepare_step(opt)       reduced slices become master.grad (unscaled)
    clip_grad_norm(opt, c)  optional, from Lightning's gradient clipping
    step(opt)               optimizer on the slices, then all-gather the updated slices
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import OffloadConfig, ZeroConfig
from lightning_zero.zero.build import BuildContext, build_bucketed, build_sharded, optimizer_owners
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.gather import GatherCoordinator, scatter_back
from lightning_zero.zero.publish import publish
from lightning_zero.zero.reduce import GradReducer
from lightning_zero.zero.step import ShardedOptimizer, check_optimizer


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
        offload: what lives in host memory instead (ZeRO-Offload).
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
        offload: OffloadConfig | None = None,
    ) -> None:
        optimizers = [_unwrap(o) for o in optimizers]
        for optimizer in optimizers:
            check_optimizer(optimizer, config.allow_untested_optimizer)
        self.config = config
        self.group = group
        self.device = device
        self.world_size = comm.world_size(group)
        self.rank = comm.rank(group)
        owners = optimizer_owners(optimizers)
        ctx = BuildContext(config, compute_dtype, separate_master, group, device, offload)
        self.frozen: list[FlatBuffer] = []
        if config.stage == 3:
            per_optimizer, self.frozen = build_sharded(module, optimizers, owners, ctx)
        else:
            # Every rank starts from rank 0's weights, as DDP does when it wraps a module.
            comm.broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), group)
            per_optimizer = build_bucketed(optimizers, ctx)
        self.sharded: dict[int, ShardedOptimizer] = {}
        self.buffers: list[FlatBuffer] = []
        for optimizer, buffers in zip(optimizers, per_optimizer, strict=True):
            self.buffers.extend(buffers)
            self.sharded[id(optimizer)] = ShardedOptimizer(optimizer, buffers, group)
        self.reducer = GradReducer(self.buffers, config.stage, group, device, config.overlap_comm)
        self.coordinator: GatherCoordinator | None = None
        if config.stage == 3:
            self.coordinator = GatherCoordinator(module, self.buffers + self.frozen, config, group)
        self._norms: dict[int, torch.Tensor] = {}

        orphans = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owners]
        if orphans and optimizers:
            warnings.warn(
                f"{len(orphans)} trainable parameters are in no optimizer (e.g. {orphans[:3]}); ZeRO neither "
                "reduces nor updates them. Freeze them (requires_grad=False) or add them to an optimizer.",
                stacklevel=2,
            )

    # -- per micro-step -----------------------------------------------------------------------

    def finish_backward(self) -> None:
        """Complete this backward's reductions. Call on all ranks after every backward."""
        self.reducer.finish()
        self.end_forward_backward()

    def end_forward_backward(self) -> None:
        """Stage 3: release what is still gathered; this pass's module order plans the next one."""
        if self.coordinator is not None:
            self.coordinator.end_step()

    @contextmanager
    def gathered_parameters(self, module: nn.Module, modifier_rank: int | None = None) -> Iterator[None]:
        """Full parameters of ``module`` inside the block (stage 3; a no-op otherwise). Edits made by
        group rank ``modifier_rank`` are scattered back into every rank's shards and fp32 masters.
        Call on all ranks."""
        ids = {id(p) for p in module.parameters()}
        # Whole parameters (stage 1/2, small ones under stage 3) are edited in place as well.
        persistent = [b for b in self.buffers if b.persistent and any(id(p) in ids for p in b.params)]
        sharded = self.coordinator.gathered_buffers(module) if self.coordinator is not None else []
        if self.coordinator is not None:
            self.coordinator.acquire(sharded)
        try:
            yield
            if modifier_rank is not None:
                scatter_back(sharded + persistent, modifier_rank, self.group)
        finally:
            if self.coordinator is not None:
                if torch.is_grad_enabled():
                    self.coordinator.pin(sharded)
                self.coordinator.drop(sharded)

    # -- per optimizer step -------------------------------------------------------------------

    def _get(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        return self.sharded[id(_unwrap(optimizer))]

    def prepare_step(self, optimizer: torch.optim.Optimizer, inv_scale: float = 1.0) -> None:
        """Expose the reduced gradient slices, unscaled, as ``master.grad``."""
        self._norms.pop(id(_unwrap(optimizer)), None)
        sharded = self._get(optimizer)
        self.reducer.reduce_for_step(sharded.buffers)
        self.reducer.wait_host_copies()
        self.reducer.add_tied(sharded.buffers)
        sharded.prepare(inv_scale)

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
        gradients (checked with ``check_overflow``: one scalar all-reduce and one host sync, before
        anything is written, so a bad batch never reaches the weights). Call on all ranks."""
        sharded = self._get(optimizer)
        overflow = check_overflow and not bool(torch.isfinite(self.grad_norm(optimizer)))
        if not overflow:
            sharded.step()
            publish(sharded.buffers, self.group, self.config.allgather_bucket_size)
        self.end_step(optimizer)
        return overflow

    def end_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step's gradients (after a step, or instead of one: nothing is updated here)."""
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

    def find(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer | None:
        return self.sharded.get(id(_unwrap(optimizer)))

    def close(self, unshard: bool = True) -> None:
        """Remove the hooks. Stage 1/2 parameters stay views of the flat buffers; stage 3 ones become
        whole again when ``unshard`` (a collective: call on all ranks), else stay empty."""
        self.reducer.remove_hooks()
        if self.coordinator is not None:
            self.coordinator.remove_hooks()
            if unshard:
                for buffer in self.buffers + self.frozen:
                    buffer.unshard(self.group)
            self.coordinator = None
