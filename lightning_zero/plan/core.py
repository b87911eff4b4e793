"""``plan()``: one rank's model-state memory and collectives of a layout, from the real engine run on
the meta device inside a fake process group of the requested size (:mod:`.world`).

Nothing here repeats the engine's arithmetic: :class:`~lightning_zero.zero.engine.ZeroEngine` is
built (partition, buckets, stage-3 units) and runs two training steps (forward, backward with its
reduction hooks, the sharded step, publish); its tensors are counted by
:func:`lightning_zero.memory.memory_breakdown` and its collectives recorded as
:mod:`lightning_zero.comm` issues them. The second step is the one reported: stage 3 plans its
prefetch from the first one's module order, as a real run does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from lightning_zero import comm
from lightning_zero.activations import apply_activation_checkpointing
from lightning_zero.config import PRECISIONS, ActivationCheckpointConfig, OffloadConfig, StrategyConfig, ZeroConfig
from lightning_zero.memory import CATEGORIES, ActivationMeter, memory_breakdown
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig
from lightning_zero.plan.disk import DiskPlan, disk_plan, disk_tier
from lightning_zero.plan.machine import Machine
from lightning_zero.plan.model import InputSpec, default_inputs, loss_fn, meta_model
from lightning_zero.plan.peak import LiveBytes, cpu_attention, host_kernel_steps, kernel_step_uncounted
from lightning_zero.plan.resident import DEFAULT, HostRuntime
from lightning_zero.plan.timing import Event, OpRecorder, StepTime, fresh_threshold, step_time
from lightning_zero.plan.world import (
    Call,
    accelerator_staging,
    cpu_step_kernels,
    fake_world,
    host_on_meta,
    record_collectives,
)

NOT_MODELED = (
    "the process group's own buffers, the allocator's slack and fragmentation, on an accelerator its "
    "runtime's own memory (CUDA context, library workspaces)",
    "on an accelerator, attention runs torch's math path on meta tensors (its scores materialized): a "
    "GPU's flash or memory-efficient kernel holds less, so the transient peak is then an upper bound "
    "(a CPU plan runs the CPU's flash kernel where torch picks it)",
    "on an accelerator, the offloaded step's host temporaries are counted in the device's peak",
    "with overlap_comm (the default), which gradient buckets the pool keeps depends on when the network "
    "completes each reduction: communication_buckets assumes none completes before it is waited for "
    "(measured up to 1.5x more on 2 gloo ranks of a small model); exact with overlap_comm=False",
    "step time: the overlap of host-device copies with compute (they are counted as compute), "
    "kernels slower than their roofline (small or odd-shaped products), the network's contention",
    "loss scaling (16-mixed), gradient clipping's norm all-reduce",
    "NVMe tiers: each request's latency, the page cache (the Python engine reads through it), the drives' "
    "sharing beyond the machine's per-rank rates; their staging buffers (nvme.staging_bytes) are not in peak",
    "optimizers other than AdamW (the plan gives every trainable parameter to one AdamW)",
)


@dataclass(frozen=True)
class CollectiveTotal:
    """All calls of one :mod:`lightning_zero.comm` function on one group in one phase."""

    group: str
    op: str
    count: int
    nbytes: int
    """Sum over the calls of the whole buffer each moves (the full tensor of a reduce-scatter or
    all-gather: each rank sends and receives about (N-1)/N of it)."""


@dataclass(frozen=True)
class Plan:
    """One rank of ``world_size`` ranks under a layout (all data-parallel, or D x T x P with
    :attr:`parallel`); bytes are per rank."""

    world_size: int
    precision: str
    device: str
    zero: ZeroConfig
    """The layout with ``"auto"`` bucket sizes resolved as the engine resolves them."""
    offload: OffloadConfig
    numel: int
    """Parameters of the model (each counted once)."""
    memory: dict[str, dict[str, int]]
    """``{"device"|"host": {category: bytes}}``, the categories of ``memory_breakdown()``."""
    pinned_host_bytes: int
    flat_buffers: int
    largest_gather_bytes: int
    """Stage 3: the largest all-gather of one step (one gathered unit, or one publish bucket)."""
    activations: int
    """Bytes autograd saves for backward in one forward of the given inputs (the
    :class:`~lightning_zero.memory.ActivationMeter` count, on meta tensors): not the peak of the
    backward, nor temporaries freed during the forward."""
    transient_peak: int
    """The most bytes a training step holds beyond what was alive when it began (saved activations,
    gradients on their way to the buckets, temporaries of forward, backward and step; with activation
    checkpointing the recomputed activations of one module at a time), from :class:`.peak.LiveBytes`.
    On CPU ranks with the kernels a CPU runs (flash attention, the single-pass AdamW: :mod:`.peak`)."""
    step: tuple[CollectiveTotal, ...]
    setup: tuple[CollectiveTotal, ...]
    untracked: int = 0
    """Bytes the engine's steps leave allocated between steps that ``memory_breakdown()`` does not
    name (e.g. the optimizer's fp32 gradient slices): part of the resident memory all the same."""
    resident: int = 0
    """CPU ranks: resident memory that is no tensor, :class:`.resident.HostRuntime`'s terms (the
    kernels' code paged in, oneDNN's kept primitives of :attr:`matmul_problems`); 0 on an accelerator."""
    matmul_problems: int = 0
    """Distinct 16-bit matrix-product problems (op, shapes, strides) of one step."""
    activation_checkpointing: tuple[str, ...] = ()
    """The checkpointed modules' qualified names."""
    not_modeled: tuple[str, ...] = field(default=NOT_MODELED)
    trace: tuple[Event, ...] = field(default=(), repr=False)
    """The second step's ops, collectives and waits in order (:mod:`.timing`)."""
    step_calls: tuple[tuple[str, int], ...] = field(default=(), repr=False)
    """The second step's collectives in order: ``(op, whole-buffer bytes)``."""
    parallel: Any = None
    """With tensor or pipeline parallelism: the layout, this rank's stage and the other planned
    stages (:class:`~lightning_zero.plan.model_parallel.ModelParallelPlan`)."""
    nvme: DiskPlan | None = None
    """The NVMe tiers' swap files, staging memory and traffic (:mod:`.disk`); None without them."""

    @property
    def nvme_bytes(self) -> int:
        """Bytes of this rank's swap files (0 without the NVMe tiers)."""
        return self.nvme.nvme_bytes if self.nvme is not None else 0

    def total(self, where: str) -> int:
        """Bytes of every category on ``where`` ("device" or "host")."""
        return sum(self.memory[where].values())

    @property
    def peak(self) -> int:
        """The device's peak of a step: its memory (:meth:`total`), :attr:`untracked`,
        :attr:`transient_peak` and (CPU ranks) :attr:`resident`."""
        return self.total("device") + self.untracked + self.transient_peak + self.resident

    def step_time(self, machine: Machine) -> StepTime:
        """This layout's training step on ``machine`` (:func:`.timing.step_time`): the engine's
        recorded step replayed on the machine's rates, with the overlap the engine does."""
        fresh = fresh_threshold(self.device, self.zero.host_mmap_threshold)
        if self.parallel is not None:  # each call on its own group's size, and the pipeline's bubble
            from lightning_zero.plan.pipeline_time import parallel_step_time

            return parallel_step_time(self, machine, fresh)
        return step_time(self.trace, self.step_calls, self.world_size, machine, fresh)


def _totals(calls: list[Call]) -> tuple[CollectiveTotal, ...]:
    counts: Counter[tuple[str, str]] = Counter()
    sizes: Counter[tuple[str, str]] = Counter()
    for call in calls:
        counts[(call.group, call.op)] += 1
        sizes[(call.group, call.op)] += call.nbytes
    order = {"data": 0}  # data-parallel first
    keys = sorted(counts, key=lambda k: (order.get(k[0], 1), k[0], k[1]))
    return tuple(CollectiveTotal(g, op, counts[(g, op)], sizes[(g, op)]) for g, op in keys)


def plan(
    model: str,
    world_size: int,
    *,
    zero: ZeroConfig | None = None,
    offload: OffloadConfig | None = None,
    precision: str = "bf16-mixed",
    device: str = "cuda",
    model_kwargs: dict[str, Any] | None = None,
    inputs: list[InputSpec] | None = None,
    micro_batch: int = 1,
    seq_len: int = 128,
    activations: ActivationCheckpointConfig | None = None,
    tensor: TensorParallelConfig | None = None,
    pipeline: PipelineConfig | None = None,
    batch_keys: tuple[str, ...] | None = None,
    host_runtime: HostRuntime | None = None,
    _stage: Any = None,
) -> Plan:
    """Plan one rank of ``world_size`` data-parallel ranks training ``model`` (``"pkg.mod:Class"``
    with ``model_kwargs``, or a Hugging Face ``config.json``: see :func:`~.model.meta_model`) with
    AdamW under the ``zero``/``offload`` layout, without allocating the model.

    ``device``: the accelerator of the ranks, ``"cuda"`` (offloaded tensors are then host memory,
    pinned when ``pin_memory``) or ``"cpu"`` (everything is host memory, counted as "device" as
    ``memory_breakdown()`` does on a CPU rank). ``inputs``: the forward's positional inputs; by
    default token ids ``(micro_batch, seq_len)`` for a Hugging Face model or a LightningModule's
    ``example_input_array``. ``activations``: activation checkpointing, as the strategy's
    ``activation_checkpointing`` option applies it. ``tensor``/``pipeline``: the strategy's
    tensor- and pipeline-parallel options; ``world_size`` is then every rank, D x T x P, and the plan
    is of one rank per differing pipeline stage (:mod:`.model_parallel`; ``batch_keys``: the names of
    the inputs in a pipeline's dict batch). ``host_runtime``: a CPU rank's non-tensor resident terms
    (default :data:`.resident.DEFAULT`; :func:`.resident.measure_host_runtime` measures this machine).
    """
    if _stage is None and ((tensor and tensor.size > 1) or (pipeline and pipeline.stages > 1) or batch_keys):
        from lightning_zero.plan.model_parallel import plan_model_parallel

        return plan_model_parallel(
            plan, model, world_size, tensor=tensor, pipeline=pipeline, batch_keys=batch_keys, zero=zero,
            offload=offload, precision=precision, device=device, model_kwargs=model_kwargs, inputs=inputs,
            micro_batch=micro_batch, seq_len=seq_len, activations=activations, host_runtime=host_runtime,
        )  # fmt: skip
    zero = zero or ZeroConfig()
    offload = offload or OffloadConfig()
    if precision not in PRECISIONS or precision == "16-mixed":
        usable = sorted(p for p in PRECISIONS if p != "16-mixed")
        raise ValueError(f"precision={precision!r}: the plan models {usable} (16-mixed's loss scaling is not modeled).")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu'.")
    activations = activations or ActivationCheckpointConfig()
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch={micro_batch} and seq_len={seq_len} must be >= 1.")
    tensor, pipeline = tensor or TensorParallelConfig(), pipeline or PipelineConfig()
    config = StrategyConfig(zero=zero, offload=offload, activations=activations, tensor=tensor, pipeline=pipeline)
    host: list[tuple[torch.Tensor, bool]] = []
    setup_calls: list[Call] = []
    step_calls: list[Call] = []
    # Stage 3's gather-order check runs on gloo data groups (CPU ranks): one small all-gather before
    # each parameter all-gather (lightning_zero.debug.GatherOrderCheck); the fake group is not gloo.
    gloo = mock.patch.object(comm, "is_plain_gloo", lambda g: device == "cpu" and comm.world_size(g) > 1)
    kernels = cpu_step_kernels() if device == "cpu" else accelerator_staging(host)
    with (
        fake_world(world_size, _stage.rank if _stage else 0) as group,
        host_on_meta(host),
        gloo,
        disk_tier(offload, host, device) as disk,
        cpu_attention(device == "cpu"),
        kernels,
    ):
        from lightning_zero.zero import ZeroEngine

        groups = {id(group): "data"}
        module = meta_model(model, model_kwargs)
        numel = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        specs = inputs if inputs is not None else default_inputs(module, micro_batch, seq_len)
        context = _stage.prepare(module, groups, setup_calls, specs, precision) if _stage else None
        params = [p for p in {id(p): p for p in module.parameters()}.values() if p.requires_grad]
        optimizer = torch.optim.AdamW(params)
        disk.optimizers.append(optimizer)
        checkpointed = apply_activation_checkpointing(module, activations, None, zero.stage == 3)
        if activations.policy is not None and not checkpointed:
            kinds = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(f"activation_checkpointing={activations.policy!r} selects no module of {kinds}.")
        with record_collectives(setup_calls, groups):
            engine = ZeroEngine(
                module, [optimizer], config=config, precision=precision, device=torch.device("meta"), parallel=context
            )
        meter = ActivationMeter(include_meta=True)
        forward: Any = (
            _stage.forward(module, engine, meter) if _stage else loss_fn(module, specs, PRECISIONS[precision][0])
        )
        events: list[Event] = []
        lives: list[LiveBytes] = []
        setup_written = disk.traffic()[1]
        # what a CPU rank's kernels allocate where they differ from torch's on meta tensors (.peak)
        host_kernel = host_kernel_steps(engine, device)
        for step in range(2):
            trace = events if step else []
            disk.events, disk.staging_peak, traffic = (trace, 0, disk.traffic()) if step else (None, 0, (0, 0))
            # the first step allocates the offloaded step's host buffers: known by the second
            host_storages = None if device == "cpu" else {t.untyped_storage()._cdata for t, _ in host}
            live = LiveBytes()
            lives.append(live)
            recorders = record_collectives(step_calls if step else [], groups, trace), OpRecorder(trace, host_storages)
            with recorders[0], recorders[1], live, kernel_step_uncounted(optimizer, lives, host_kernel):
                meter.start()
                try:
                    loss = forward(trace) if _stage else forward()
                except (RuntimeError, TypeError, IndexError) as error:
                    raise ValueError(
                        f"{type(module).__name__}'s forward failed on meta inputs {[(s, str(d)) for s, d in specs]}: "
                        f"{error}. Give the forward's inputs with their shapes and dtypes (--input 8,128:int64)."
                    ) from error
                finally:
                    meter.stop(module)
                trace.append(("phase", "backward"))
                if loss is not None:  # else the pipeline's schedule ran the backwards and reductions
                    loss.backward()
                    engine.backward_done()
                trace.append(("phase", "optimizer"))
                engine.step(optimizer)
        memory = _count(module, engine, host, offload, device)
        nvme = disk_plan(disk, traffic, disk.traffic(), setup_written)
        untracked = _untracked(module, engine, lives)
        problems = len(live.matmul_problems)
        resolved = engine.config.zero
        flat = len(engine.memory_tensors()["parameters"])
        engine.close(unshard=False)
    gathers = [c.nbytes for c in step_calls if c.op == "all_gather"]
    return Plan(
        world_size=world_size,
        precision=precision,
        device=device,
        zero=resolved,
        offload=offload,
        numel=numel,
        memory=memory,
        pinned_host_bytes=_pinned(host, offload, device),
        flat_buffers=flat,
        largest_gather_bytes=max(gathers) if resolved.stage == 3 and gathers else 0,
        activations=meter.last,
        step=_totals(step_calls),
        setup=_totals(setup_calls),
        transient_peak=live.peak,
        untracked=untracked,
        resident=(host_runtime or DEFAULT).resident(problems) if device == "cpu" else 0,
        matmul_problems=problems,
        activation_checkpointing=tuple(checkpointed),
        trace=tuple(events),
        step_calls=tuple((c.op, c.nbytes) for c in step_calls),
        nvme=nvme,
        parallel=_stage.result(module, step_calls) if _stage else None,
    )


def _count(
    module: torch.nn.Module, engine: Any, host: list[tuple[torch.Tensor, bool]], offload: OffloadConfig, device: str
) -> dict[str, dict[str, int]]:
    on_host = {t.untyped_storage()._cdata for t, _ in host}
    states = {id(t) for t in engine.memory_tensors()["optimizer_states"]}

    def place(tensor: torch.Tensor) -> str:
        if device == "cpu":
            return "device"
        if tensor.device.type == "cpu":  # optimizer step counters
            return "host"
        if tensor.untyped_storage()._cdata in on_host:
            return "host"
        # optimizer states are created beside their fp32 master slice
        return "host" if offload.optimizer_tier is not None and id(tensor) in states else "device"

    breakdown = memory_breakdown(module, engine, torch.device(device), place=place)
    return {where: {c: breakdown[where][c] for c in CATEGORIES} for where in ("device", "host")}


def _untracked(module: torch.nn.Module, engine: Any, lives: list[LiveBytes]) -> int:
    """Bytes created during the steps, alive after them, and in no ``memory_breakdown()`` category."""
    named = [t for tensors in engine.memory_tensors().values() for t in tensors]
    named += [*module.parameters(), *module.buffers()]
    counted = {t.untyped_storage()._cdata for t in named}
    return sum(nbytes for live in lives for key, nbytes in live.alive().items() if key not in counted)


def _pinned(host: list[tuple[torch.Tensor, bool]], offload: OffloadConfig, device: str) -> int:
    if device != "cuda" or not offload.pin_memory:
        return 0  # lightning_zero.offload.host pins only when a GPU is there
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t, pin in host if pin}
    return sum(storages.values())
