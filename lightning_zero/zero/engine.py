"""The ZeRO engine: the one owner of a model's flat buffers, gradients and optimizer states, driving
the data path (partition -> gather -> reduce -> step -> publish) for stages 1, 2 and 3.

Built once per fit from one :class:`~lightning_zero.config.StrategyConfig`, a precision string and a
:class:`~lightning_zero.zero.surface.ModelParallelContext`. Every other layer uses only the methods
below; flat buffers, the sharded optimizer and the gradient reducer do not leave ``zero/``.

Per micro-step and optimizer step (the precision plugin, the pipeline runner and the strategy call)::

    [forward/backward]      stage 3 hooks gather; reducer hooks fill buckets and reduce-scatter them
    backward_done()         after every backward: remaining reductions complete
    end_pass()              stage 3: release what is gathered; this pass's module order plans the next
    step(opt, before_update=...)
                            reduced slices become master.grad (unscaled); ``before_update`` runs the
                            user's hooks and clipping (grad_norm, clip_grad_norm); then the optimizer
                            on the slices, publish (pipelined with the kernels: each buffer's all-gather
                            starts as soon as it is stepped, ``OffloadConfig.pipeline``), and the
                            gradients are dropped
    step_through(opt, closure, ...)
                            the Trainer's form of step(): the same work inside the user's own
                            ``optimizer.step(closure=...)`` (:mod:`lightning_zero.zero.user_step`)

Checkpoints and reports: :meth:`held_params`, :meth:`publish`, :meth:`param_groups`,
:meth:`memory_tensors`, and the checkpoint surface of :mod:`~lightning_zero.zero.engine_checkpoint`
(``local_pieces``, ``load_pieces``, ``load_optimizer_pieces``, ``load_consolidated``).

This module builds the engine and holds what it owns; its surface comes in mixins, one per concern:
:mod:`~lightning_zero.zero.engine_step` (``step``, ``step_through``, ``grad_norm``, the clipping,
``zero_grad``), :mod:`~lightning_zero.zero.engine_gather` (stage 3: ``end_pass``, ``step_scope``,
``gathered_parameters``), :mod:`~lightning_zero.zero.engine_grads` (``param.grad`` for user code:
``full_gradients``, ``expose_window``), :mod:`~lightning_zero.zero.engine_groups`
(``add_param_groups``: parameter groups added during fit) and :mod:`~lightning_zero.zero.engine_checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import PRECISIONS, StrategyConfig, grad_dtype
from lightning_zero.offload.nvme import SwapStore
from lightning_zero.zero.build import (
    BuildContext,
    Holders,
    build_bucketed,
    build_sharded,
    describe_held,
    fp32_norm_params,
    optimizer_owners,
)
from lightning_zero.zero.deferred import Recording
from lightning_zero.zero.engine_checkpoint import CheckpointSurface, _unwrap
from lightning_zero.zero.engine_gather import GatherSurface
from lightning_zero.zero.engine_grads import GradientWindow
from lightning_zero.zero.engine_groups import AddedGroups
from lightning_zero.zero.engine_step import OptimizerSteps
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.gather import GatherCoordinator
from lightning_zero.zero.grads import ExposedGrads
from lightning_zero.zero.publish import publish
from lightning_zero.zero.reduce import GradReducer
from lightning_zero.zero.replicated import ReplicatedOptimizer, check_whole_model
from lightning_zero.zero.shared import SharedGrads
from lightning_zero.zero.step import ShardedOptimizer, check_optimizer, state_tensors
from lightning_zero.zero.surface import (
    HeldParam,
    ModelParallelContext,
    ParamGroup,
)
from lightning_zero.zero.swap import BuildToDisk, EngineSwap, ParamTier
from lightning_zero.zero.swap_grads import GradTier
from lightning_zero.zero.whole import declared_whole_model, host_held


class ZeroEngine(OptimizerSteps, AddedGroups, GatherSurface, GradientWindow, CheckpointSurface):
    """Flat buffers, gradient reduction and sharded steps for ``optimizers`` of ``module``.

    Args:
        module: the model; its parameters become views into flat buffers of the compute dtype.
        optimizers: the optimizers from ``configure_optimizers``; they step master slices
            (none under stage 3 evaluation, which shards the model all the same).
        config: the strategy's options; the engine reads its ``zero`` and ``offload`` sections.
        precision: "32-true", "bf16-mixed", "16-mixed" or "bf16-true": the compute dtype and whether
            an fp32 master is kept (:data:`~lightning_zero.config.PRECISIONS`).
        device: where flat buffers live.
        parallel: the data-parallel group ZeRO shards over, the model-parallel groups and the
            parameters tied across pipeline stages.
        recordings: how meta parameters were built (``configure_model`` under stage 3); stage 3
            replays them into the shards (see :mod:`lightning_zero.zero.deferred`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        *,
        config: StrategyConfig,
        precision: str,
        device: torch.device,
        parallel: ModelParallelContext | None = None,
        recordings: Sequence[Recording] = (),
    ) -> None:
        parallel = parallel or ModelParallelContext()
        optimizers = [_unwrap(o) for o in optimizers]
        for optimizer in optimizers:
            check_optimizer(optimizer, config.zero.allow_untested_optimizer)
        # "auto" bucket sizes from the model's size (every rank sees the same module: same sizes)
        numel = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values() if p.is_floating_point())
        zero, ddp = config.zero, config.data_parallel
        # DDP's bucket_cap_mb: as many elements of the gradient buckets' dtype as fit in that many MiB
        bucket_bytes = grad_dtype(zero.reduce_dtype, PRECISIONS[precision][0]).itemsize
        if (from_mb := ddp.reduce_bucket_numel(bucket_bytes)) is not None:
            zero, ddp = (
                dataclasses.replace(zero, reduce_bucket_size=from_mb),
                dataclasses.replace(ddp, bucket_cap_mb=None),
            )
        config = dataclasses.replace(config, zero=zero.sized_for(numel), data_parallel=ddp)
        self.config = config
        self.group = group = parallel.data
        self.device = device
        owners = optimizer_owners(optimizers)
        check_whole_model(optimizers, config, precision, owners, parallel)
        nvme = config.offload.nvme
        disk_masters = config.offload.optimizer_tier == "nvme" and bool(optimizers)
        disk_params = config.offload.parameter_tier == "nvme" and config.zero.stage == 3
        # One directory per rank, shared by the disk tiers; made before the build, which under stage 3
        # writes each buffer's slices into it as soon as they exist (BuildToDisk).
        store = SwapStore(nvme, comm.rank(None)) if nvme is not None and (disk_masters or disk_params) else None
        sink = None
        if store is not None and config.zero.stage == 3:
            grads = disk_masters and device.type == "cpu"  # the gradient tier below will hold them
            kept = host_held(optimizers)  # (whole-tensor groups: their masters and gradients stay in memory)
            sink = BuildToDisk(store, masters=disk_masters, params=disk_params, grads=grads, in_memory=kept)
        #: the stage-3 build's writer into the disk tier (None without one)
        self.build_to_disk = sink
        self._states_dropped = False  # the disk tier was closed without reading the states back
        self._published_on_load: set[int] = set()  # buffers load_pieces already cast (the disk tier)
        try:
            self._build(module, optimizers, owners, precision, parallel, recordings, store, sink)
        except BaseException:
            if store is not None:
                store.close(bring_back=False)  # nothing of this run stays on disk
            raise
        self._reducer = GradReducer(
            self._buffers,
            stage=config.zero.stage,
            group=group,
            device=device,
            overlap_comm=config.zero.overlap_comm,
            tied=parallel.tied,
            pool=self._ctx.pool,
        )
        self._coordinator: GatherCoordinator | None = None
        if config.zero.stage == 3:
            self._coordinator = GatherCoordinator(
                module, self._buffers + self._frozen, config.zero, group, shard_tier=self.param_tier
            )
        self._norms: dict[int, torch.Tensor] = {}
        self._exposed: ExposedGrads | None = None  # inside full_gradients
        self._window: ExposedGrads | None = None  # manual optimization: expose_window
        self._prepared: set[int] = set()  # optimizers whose slices hold this window's reduced gradients
        self._routed: list[torch.optim.Optimizer] = []
        if parallel.pipeline is None:
            # Under a pipeline the schedule runs every backward inside training_step, and Lightning
            # calls zero_grad between training_step and its (then empty) backward: not routed there.
            for optimizer in optimizers:
                self._route_zero_grad(optimizer)
        self._held = self._describe()

        orphans = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owners]
        if orphans and optimizers:
            warnings.warn(
                f"{len(orphans)} trainable parameters are in no optimizer (e.g. {orphans[:3]}); ZeRO neither "
                "reduces nor updates them. Freeze them (requires_grad=False) or add them to an optimizer.",
                stacklevel=2,
            )

    def _build(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        owners: dict[int, Holders],
        precision: str,
        parallel: ModelParallelContext,
        recordings: Sequence[Recording],
        store: SwapStore | None,
        sink: BuildToDisk | None,
    ) -> None:
        """Flat buffers, sharded optimizers and the disk tiers (``store``: the rank's swap files)."""
        config, group, device = self.config, self.group, self.device
        disk_masters = config.offload.optimizer_tier == "nvme" and bool(optimizers)
        disk_params = config.offload.parameter_tier == "nvme" and config.zero.stage == 3
        nvme = config.offload.nvme
        compute_dtype, separate_master = PRECISIONS[precision]
        ctx = BuildContext(
            config=config.zero,
            offload=config.offload,
            dtype=compute_dtype,
            grad_dtype=grad_dtype(config.zero.reduce_dtype, compute_dtype),
            separate_master=separate_master,
            group=group,
            device=device,
            recordings=tuple(recordings),
            sink=sink,
            keep_param_dtypes=precision == "32-true",  # as DDP (Lightning's 32-true casts nothing)
            fp32_params=fp32_norm_params(module) if separate_master else frozenset(),
        )
        self._frozen: list[FlatBuffer] = []
        self._ctx = ctx  # parameter groups added during fit get their buffers from it
        if config.zero.stage == 3:
            built = build_sharded(module, optimizers, owners, ctx)
        else:
            # Every rank starts from rank 0's weights, as DDP does when it wraps a module.
            comm.broadcast_tensors([p.data for p in module.parameters()] + list(module.buffers()), group)
            built = build_bucketed(optimizers, owners, ctx)
        self._frozen = built.frozen
        elsewhere = frozenset(id(t.param) for t in parallel.tied if not t.counted_here)
        self._optimizers = optimizers
        self._sharded: dict[int, ShardedOptimizer] = {}
        self._buffers: list[FlatBuffer] = []  # each once, also those several optimizers hold
        holders: dict[int, int] = {}  # id(buffer) -> how many optimizers hold it
        for optimizer, buffers, group_of in zip(optimizers, built.per_optimizer, built.group_of, strict=True):
            self._buffers.extend(b for b in buffers if id(b) not in holders)
            holders.update({id(b): holders.get(id(b), 0) + 1 for b in buffers})
            kind = ReplicatedOptimizer if declared_whole_model(optimizer) else ShardedOptimizer  # LBFGS: replicated
            self._sharded[id(optimizer)] = kind(
                optimizer,
                buffers,
                group_of=group_of,
                group=group,
                tensor_parallel_group=parallel.tensor,
                pipeline_parallel_group=parallel.pipeline,
                counted_elsewhere=elsewhere,
            )
        #: gradients of the parameters several optimizers hold, as DDP's one param.grad (zero/shared.py)
        self._shared = SharedGrads([b for b in self._buffers if holders[id(b)] > 1], group)
        #: the disk tier (offload_optimizer="nvme"): masters and moments in files between steps
        self.swap: EngineSwap | None = None
        if config.offload.optimizer_tier == "nvme" and self._shared.accumulated:
            raise ValueError(
                f"{len(self._shared.accumulated)} flat buffers hold parameters given to several optimizers, which "
                'offload_optimizer="nvme" does not support (its swap files hold one optimizer\'s states per '
                'master); give each parameter to one optimizer, or use offload_optimizer="cpu".'
            )
        #: the parameter disk tier (offload_parameters="nvme", stage 3): parameter shards in files
        self.param_tier: ParamTier | None = None
        #: the gradient disk tier (offload_optimizer="nvme", stages 2/3): reduced gradient slices in files
        self.grad_tier: GradTier | None = None
        sharded_buffers = [b for b in self._buffers + self._frozen if not b.persistent]
        wants_params = disk_params and bool(sharded_buffers)
        if store is not None:
            assert nvme is not None
            if disk_masters:
                self.swap = EngineSwap(list(self._sharded.values()), store)
            if wants_params:
                self.param_tier = ParamTier(sharded_buffers, store, nvme)
            if self.swap is not None and config.zero.stage >= 2:
                # gradient slices on disk too (zero/swap_grads.py); stage 1 keeps whole buckets in memory
                on_host = [b for b in self.swap.buffers() if b.grad_shard is not None and store.is_host(b.grad_shard)]
                self.grad_tier = GradTier(on_host, store, nvme) if on_host else None
            if self.swap is None and self.param_tier is None:
                store.close(bring_back=False)  # nothing to keep on disk after all

    # -- per micro-step -----------------------------------------------------------------------

    def backward_done(self) -> None:
        """Complete this backward's reductions. Call on all ranks after every backward."""
        self._reducer.finish()
        if self.grad_tier is not None:
            self.grad_tier.flush()  # every slice of this backward written and freed
        self.end_pass()

    # -- the state other layers read and write ------------------------------------------------------

    def _all_buffers(self) -> list[FlatBuffer]:
        return self._buffers + self._frozen

    def _describe(self) -> list[HeldParam]:
        optimizers_of: dict[int, tuple[int, ...]] = {}
        for o, opt in enumerate(self._optimizers):
            for b in self._sharded[id(opt)].buffers:
                optimizers_of[id(b)] = optimizers_of.get(id(b), ()) + (o,)
        return describe_held(self._all_buffers(), optimizers_of)

    def held_params(self) -> list[HeldParam]:
        """Every parameter in the engine's flat buffers, in buffer order: those of the optimizers,
        then (stage 3) frozen ones, which are partitioned without an optimizer. Local."""
        return list(self._held)

    def param_groups(self, optimizer: torch.optim.Optimizer) -> list[ParamGroup]:
        """The parameter groups of a ZeRO-managed optimizer as the user built them."""
        sharded = self._get(optimizer)
        return [
            ParamGroup({k: v for k, v in group.items() if k != "params"}, tuple(original))
            for group, original in zip(sharded.optimizer.param_groups, sharded.original_params, strict=True)
        ]

    def window_state(self) -> dict[str, Any] | None:
        """This rank's gradients accumulated since the last step (a checkpoint saved in the middle of
        an accumulation window), as host copies; ``None`` at a window boundary. Local."""
        return self._reducer.window_state()

    def load_window_state(self, state: dict[str, Any]) -> None:
        """Put back :meth:`window_state` (same stage, world size and buckets; ``ValueError`` otherwise). Local."""
        self._reducer.load_window_state(state)

    def publish(self) -> None:
        """Master slices -> parameters, after loading (stages 1/2: all-gathered, as after a step).
        Call on all ranks."""
        buffers = self._all_buffers()
        cast, self._published_on_load = self._published_on_load, set()
        for buffer in buffers:
            if not buffer.separate_master or id(buffer) in cast:
                continue  # the parameter slice is the master, or load_pieces cast it (no second read)
            with contextlib.ExitStack() as stack:  # the disk tier: one buffer in memory at a time
                stack.enter_context(self._buffer_resident(buffer))
                if buffer.shard_tier is not None:
                    stack.enter_context(buffer.shard_tier.rewrite([buffer]))
                buffer.params_from_master()  # publish() only all-gathers what the parameter slices hold
        publish(buffers, self.group, self.config.zero.allgather_bucket_size)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The engine's live tensors by category (see :func:`lightning_zero.memory.memory_breakdown`),
        in the order they should be counted (views of a counted storage are not counted again)."""
        every = self._all_buffers()
        stage1 = self.config.zero.stage == 1
        out: dict[str, list[torch.Tensor]] = {
            "parameters": [t for b in every if (t := b.flat_param if b.persistent else b.param_shard) is not None]
            # offload with a GPU: the (pinned) host copies the kernel writes the updated 16-bit slices into
            + [t for s in self._sharded.values() for t in s.host_staging()],
            "master_weights": [b.master for b in self._buffers if b.separate_master],
            "gradients": [b.grad_bucket for b in self._buffers if stage1 and b.grad_bucket is not None]
            + [b.grad_shard for b in self._buffers if b.grad_shard is not None]
            # offload with a GPU: the (pinned) host copies of the gradient slices the host optimizer reads
            + [b.host_grad for b in self._buffers if b.host_grad is not None and b.host_grad.device != b.device],
            # buckets in use and free pooled blocks (buckets and stage 3's gathers: see pools.py)
            "communication_buckets": [b.grad_bucket for b in self._buffers if not stage1 and b.grad_bucket is not None]
            + self._ctx.pool.free,
            "optimizer_states": [
                value
                for s in self._sharded.values()
                for state in s.optimizer.state.values()
                for value in state_tensors(state)  # (LBFGS keeps lists of tensors)
            ],
        }
        return out

    # -- teardown ---------------------------------------------------------------------------------

    def close(self, unshard: bool = True) -> None:
        """Remove the hooks. Stage 1/2 parameters stay views of the flat buffers; stage 3 ones become
        whole again when ``unshard`` (a collective: call on all ranks), else stay empty. With a disk
        tier, ``unshard`` is also subject to nvme ``restore_after_fit`` (see :class:`NvmeConfig`): when
        it resolves to False, neither the model nor the optimizer states come back into memory."""
        self._reducer.remove_hooks()
        nvme = self.config.offload.nvme
        if nvme is not None and (self.swap is not None or self.param_tier is not None):
            restore = nvme.restore_after_fit
            # default: the parameters on disk mean the whole model may not fit in RAM (same on every rank)
            unshard = unshard and (restore if restore is not None else self.param_tier is None)
        if self._coordinator is not None and unshard:
            # Before the files go: under the parameter disk tier the gathers read the shards from them.
            for buffer in self._all_buffers():
                buffer.unshard(self.group)
        store = self.swap.store if self.swap is not None else None
        if self.grad_tier is not None:
            self.grad_tier.close(bring_back=unshard)
            self.grad_tier = None
        if self.param_tier is not None:
            store = self.param_tier.store
            self.param_tier.close()
            self.param_tier = None
        if self.swap is not None:
            # After a finished fit the states come back to host memory (a checkpoint after fit
            # still saves them) unless nvme restore_after_fit=False; after a failure the files are
            # simply removed.
            self.swap.close(bring_back=unshard)
            self.swap = None
            self._states_dropped = not unshard
        elif store is not None:
            store.close(bring_back=False)
            self._states_dropped = not unshard  # the parameter shards went with their files
        for optimizer in self._routed:
            optimizer.__dict__.pop("zero_grad", None)  # back to the class's zero_grad
        self._routed.clear()
        if self._coordinator is not None:
            self._coordinator.remove_hooks()
            self._coordinator = None
