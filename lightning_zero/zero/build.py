"""Turning a model and its optimizers into flat buffers (the tensors behind step 1, partition).

Stages 1 and 2 pack each optimizer parameter group, in reverse registration order (the order
autograd produces gradients), into buckets of ``reduce_bucket_size`` elements; the parameters stay
whole on every rank (persistent buffers).

Stage 3 walks the modules in registration order and gives each module's own parameters a sharded
buffer per optimizer parameter group (frozen parameters get one too, without master or gradients):
the unit that is gathered before the module runs. Parameters of at most
``param_persistence_threshold`` elements stay whole, in stage-2 buckets. A module whose parameters
are on the meta device (built in ``LightningModule.configure_model`` under stage 3) is materialized
here, one module at a time: its tensors are allocated on the device, its ``reset_parameters()``
initializes them, rank 0's values are broadcast, the rank keeps its slice and the full tensors are
freed before the next module, so no rank ever holds more than its shards plus one module. Under
the disk tiers (``offload_optimizer="nvme"``, ``offload_parameters="nvme"``) each buffer's master and
shard go to their files as soon as it is built (``BuildContext.sink``), so the shards are not held
either: at most one module is in memory.

A parameter given to several optimizers (a GAN's shared embedding) goes, at every stage, into a
buffer holding only parameters with the same set of holders; the buffer is in each holder's list,
with the holder's own group index (:class:`Built`), so each optimizer keeps its own state of the
one master slice (gradients: :mod:`lightning_zero.zero.shared`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import OffloadConfig, ZeroConfig
from lightning_zero.zero.deferred import Recording
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.partition import layout_flat_buffer, plan_buckets
from lightning_zero.zero.pools import BlockPool
from lightning_zero.zero.surface import HeldParam

_SUPPORTED_PARAM_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class BuildContext:
    """What every buffer of one engine shares."""

    config: ZeroConfig
    offload: OffloadConfig
    dtype: torch.dtype
    """The compute dtype of parameters."""
    grad_dtype: torch.dtype | None = None
    """The dtype gradients are reduced and kept in (``ZeroConfig.reduce_dtype``); ``dtype`` when None."""
    separate_master: bool
    """Keep an fp32 master slice (mixed precision)."""
    group: comm.ProcessGroup
    """The data-parallel group."""
    device: torch.device
    recordings: tuple[Recording, ...] = ()
    """How meta parameters were built (``configure_model`` under stage 3), for :func:`materialize`."""
    pool: BlockPool = field(default_factory=BlockPool)
    """Gathered parameters and gradient buckets of the engine (:mod:`~lightning_zero.zero.pools`)."""
    sink: Callable[[FlatBuffer], None] | None = None
    """Stage 3: called with each sharded buffer as soon as it is built (the disk tier writes its
    slices to files and frees them: :class:`lightning_zero.zero.swap.BuildToDisk`)."""
    keep_param_dtypes: bool = False
    """"32-true": every parameter keeps its own dtype, as under DDP (a ``.double()`` sub-module stays
    float64, in flat buffers of its own); otherwise every floating parameter gets ``dtype``."""
    fp32_params: frozenset[int] = frozenset()
    """Ids of the parameters kept in fp32 under mixed precision (:func:`fp32_norm_params`)."""

    def dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param`` has in its flat buffer."""
        if self.keep_param_dtypes:
            return param.dtype
        return torch.float32 if id(param) in self.fp32_params else self.dtype

    @property
    def rank(self) -> int:
        return comm.rank(self.group)

    @property
    def world_size(self) -> int:
        return comm.world_size(self.group)

    def buffer(self, params: list[nn.Parameter], group: int | None, persistent: bool) -> FlatBuffer:
        layout = layout_flat_buffer([p.shape for p in params], self.world_size)
        dtype = self.dtype_of(params[0])
        assert all(self.dtype_of(p) == dtype for p in params), "one flat buffer holds one dtype"
        return FlatBuffer(
            params,
            layout,
            rank=self.rank,
            optimizer_group=group,
            dtype=dtype,
            # reduce_dtype applies to the compute dtype's buffers; a kept float64 one reduces in float64
            grad_dtype=self.grad_dtype if dtype == self.dtype else dtype,
            device=self.device,
            separate_master=self.separate_master,
            persistent=persistent,
            offload=self.offload,
            pool=self.pool,
        )

    def buckets(self, params: list[nn.Parameter], group: int) -> list[FlatBuffer]:
        """Buckets of at most ``reduce_bucket_size`` elements, each of one dtype (order kept within a dtype)."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(self.dtype_of(p), []).append(p)
        out = []
        for same in by_dtype.values():
            runs = plan_buckets([p.numel() for p in same], self.config.reduce_bucket_numel)
            out += [self.buffer([same[i] for i in run], group, persistent=True) for run in runs]
        return out


def fp32_norm_params(module: nn.Module) -> frozenset[int]:
    """The ids of the parameters that stay fp32 under 16-bit mixed precision: those of batch-norm
    layers (``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones).
    Their running statistics are fp32 buffers, and torch's kernels take a 16-bit input with fp32
    weights and statistics (what autocast gives under DDP), not 16-bit weights beside fp32 statistics."""
    found: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            found.update(id(p) for p in sub.parameters(recurse=False) if p.is_floating_point())
    return frozenset(found)


Holders = tuple[tuple[int, int], ...]
"""``((optimizer index, group index), ...)``: every optimizer parameter group holding one parameter
(more than one when the same parameter is given to several optimizers, e.g. a GAN's shared embedding)."""


def optimizer_owners(optimizers: list[torch.optim.Optimizer]) -> dict[int, Holders]:
    """``id(param) -> holders`` of every trainable parameter, in optimizer order; rejects
    unsupported dtypes with a ValueError before anything is allocated. (torch itself refuses a
    parameter in two groups of one optimizer.)"""
    owners: dict[int, Holders] = {}
    for o_index, optimizer in enumerate(optimizers):
        for g_index, param_group in enumerate(optimizer.param_groups):
            for param in param_group["params"]:
                if not param.requires_grad:
                    continue
                if param.dtype not in _SUPPORTED_PARAM_DTYPES:
                    raise ValueError(
                        f"a parameter of shape {tuple(param.shape)} has dtype {param.dtype}; ZeRO supports "
                        f"{[str(d) for d in _SUPPORTED_PARAM_DTYPES]}. Convert the model or freeze the parameter."
                    )
                owners[id(param)] = owners.get(id(param), ()) + ((o_index, g_index),)
    return owners


@dataclass
class Built:
    """What the build gives the engine: per optimizer its buffers and, per buffer, the optimizer's
    parameter group it joins (a buffer of shared parameters is in every holder's list)."""

    per_optimizer: list[list[FlatBuffer]]
    group_of: list[dict[int, int]]
    """Per optimizer: ``id(buffer) -> group index``."""
    frozen: list[FlatBuffer]

    def add(self, holders: Holders, buffer: FlatBuffer) -> None:
        for o_index, g_index in holders:
            self.per_optimizer[o_index].append(buffer)
            self.group_of[o_index][id(buffer)] = g_index


def build_bucketed(optimizers: list[torch.optim.Optimizer], owners: dict[int, Holders], ctx: BuildContext) -> Built:
    """Stages 1 and 2: per optimizer, its buffers. Parameters held by several optimizers get buckets
    of their own (one per set of holders), after their first holder's own buckets."""
    built = Built([[] for _ in optimizers], [{} for _ in optimizers], [])
    for o_index, optimizer in enumerate(optimizers):
        for g_index, param_group in enumerate(optimizer.param_groups):
            trainable = [p for p in reversed(param_group["params"]) if p.requires_grad]
            exclusive = [p for p in trainable if len(owners[id(p)]) == 1]
            for buffer in ctx.buckets(exclusive, g_index):
                built.add(((o_index, g_index),), buffer)
            shared: dict[Holders, list[nn.Parameter]] = {}
            for p in trainable:
                if owners[id(p)][0] == (o_index, g_index) and len(owners[id(p)]) > 1:
                    shared.setdefault(owners[id(p)], []).append(p)
            for holders, params in shared.items():
                for buffer in ctx.buckets(params, g_index):
                    built.add(holders, buffer)
    return built


def _drop_meta_graphs(module: nn.Module) -> None:
    """Detach the meta tensors a module keeps as plain attributes with an autograd graph: the old
    hook-based ``torch.nn.utils.weight_norm`` stores ``weight = g * v / |v|`` so, and the graph holds
    references to the parameters, which torch.utils.swap_tensors refuses. Such a tensor has no
    values (meta) and the hook computes it again from the parameters before every forward."""
    for key, value in vars(module).items():
        if isinstance(value, torch.Tensor) and value.is_meta and value.grad_fn is not None:
            vars(module)[key] = value.detach()


def materialize(name: str, module: nn.Module, device: torch.device, recordings: tuple[Recording, ...] = ()) -> None:
    """Give a module's own meta tensors real values on ``device``: the values the unsharded build
    gives, replayed from the recording of ``configure_model`` (:mod:`lightning_zero.zero.deferred`).
    A tensor no recorded op ever wrote (``torch.empty`` left as it is; or built on meta outside the
    recorder) is initialized by the module's ``reset_parameters()``, as FSDP does (the module's
    recorded tensors keep their values); without one, a ValueError names it. Parameter objects keep their identity (optimizers and ties hold them)."""
    metas = [(n, p) for n, p in module._parameters.items() if p is not None and p.is_meta]
    meta_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
    if not metas and not meta_buffers:
        return

    def replayed(t: torch.Tensor) -> torch.Tensor | None:
        recording = next((r for r in recordings if r.recorded(t)), None)
        if recording is None or not recording.initialized(t):
            return None
        return recording.materialize(t).to(device)

    unset = []
    # An RNN holds weak references to its parameters (``_flat_weight_refs``), which swap_tensors
    # refuses; dropped here as RNNBase._apply drops them, and rebuilt below from the parameters.
    if isinstance(module, nn.RNNBase):
        module._flat_weight_refs = []
    _drop_meta_graphs(module)
    for param_name, param in metas:
        value = replayed(param)
        if value is None:
            unset.append(param_name)
            value = torch.empty(param.shape, dtype=param.dtype, device=device)
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    if isinstance(module, nn.RNNBase):
        module._init_flat_weights()
    for buffer_name in meta_buffers:
        meta = module._buffers[buffer_name]
        assert meta is not None
        value = replayed(meta)
        if value is None:
            unset.append(buffer_name)
            value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        module._buffers[buffer_name] = value
    if not unset:
        return
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset) and any(r.empty_init for r in recordings):
        # init_module(empty_init=True): uninitialized memory under DDP, which the program overwrites (a
        # load after setup); zeros here, so that every rank holds the same
        for tensor_name in unset:
            getattr(module, tensor_name).data.zero_()
        return
    if not callable(reset):
        raise ValueError(
            f"{', '.join(unset)} of module {name or '<root>'} ({type(module).__name__}) were built on the meta device "
            "(configure_model under stage 3) but nothing ever wrote their values, and the module has no "
            "reset_parameters() to initialize them. Initialize them where they are created (e.g. torch.zeros "
            "instead of torch.empty), or give the module a reset_parameters()."
        )
    # reset_parameters() initializes the whole module: the tensors the recording wrote keep those values
    written = {n: t.detach().clone() for n, t in [*module._parameters.items(), *module._buffers.items()]
               if t is not None and n not in unset}  # fmt: skip
    with torch.no_grad():
        reset()
        for tensor_name, value in written.items():
            getattr(module, tensor_name).copy_(value)


def build_sharded(
    module: nn.Module, optimizers: list[torch.optim.Optimizer], owners: dict[int, Holders], ctx: BuildContext
) -> Built:
    """Stage 3: per optimizer its buffers (sharded units in reverse module order, then persistent
    buckets), and the sharded buffers of frozen parameters. A module's parameters held by several
    optimizers form a unit of their own, in every holder's list."""
    units_in_order: list[tuple[Holders, FlatBuffer]] = []
    persistent: dict[Holders, list[nn.Parameter]] = {}
    frozen: list[FlatBuffer] = []
    claimed: set[int] = set()
    threshold = ctx.config.param_persistence_threshold
    for name, sub in module.named_modules():
        materialize(name, sub, ctx.device, ctx.recordings)
        own = [p for p in sub._parameters.values() if p is not None and id(p) not in claimed]
        claimed.update(id(p) for p in own)
        # Every rank must start from the same weights (rank 0's), as DDP does; module by module so
        # that only one module is ever whole.
        comm.broadcast_tensors([p.data for p in own] + [b for b in sub._buffers.values() if b is not None], ctx.group)
        units: dict[tuple[Holders | None, torch.dtype], list[nn.Parameter]] = {}
        for param in own:
            key = owners.get(id(param))
            if not param.is_floating_point():
                continue
            if param.numel() <= threshold:
                if key is not None:
                    persistent.setdefault(key, []).append(param)
                continue  # small frozen parameters stay whole and untouched
            units.setdefault((key, ctx.dtype_of(param)), []).append(param)
        for (key, _), params in units.items():
            buffer = ctx.buffer(params, None if key is None else key[0][1], persistent=False)
            if ctx.sink is not None:
                ctx.sink(buffer)  # to disk before the next module is materialized
            if key is None:
                frozen.append(buffer)
            else:
                units_in_order.append((key, buffer))
    built = Built([[] for _ in optimizers], [{} for _ in optimizers], frozen)
    for key, buffer in reversed(units_in_order):
        built.add(key, buffer)
    for key, params in persistent.items():
        for buffer in ctx.buckets(list(reversed(params)), key[0][1]):
            built.add(key, buffer)
    return built


def describe_held(buffers: list[FlatBuffer], optimizers_of: dict[int, tuple[int, ...]]) -> list[HeldParam]:
    """Every parameter of ``buffers`` as the checkpoint layer sees it, in buffer order: its shape,
    dtypes, every rank's pieces and this rank's. ``optimizers_of``: ``id(buffer)`` -> the indices of
    the optimizers stepping it."""
    out = []
    for b_index, b in enumerate(buffers):
        local = {s.param_index: (s.param_offset, s.shard_offset, s.numel) for s in b.shards}
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for rank in range(b.layout.world_size):
            for s in b.layout.shards(rank):
                pieces.setdefault(s.param_index, []).append((rank, s.param_offset, s.numel))
        for index, (param, slot) in enumerate(zip(b.params, b.layout.slots, strict=True)):
            held = HeldParam(
                param=param,
                shape=slot.shape,
                dtype=b.param_shard.dtype,
                saved_dtype=b.master.dtype,
                optimizers=optimizers_of.get(id(b), ()),
                buffer=b_index,
                pieces=tuple(pieces.get(index, ())),
                local=local.get(index),
            )
            out.append(held)
    return out
