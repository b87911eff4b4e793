"""``plan --search``: every layout of a model that fits a machine, ranked by predicted throughput.

Each candidate is a full :func:`~.core.plan` (the engine on meta tensors), so what fits is what the
engine would allocate, and its speed is its recorded step replayed on the machine
(:meth:`~.core.Plan.step_time`). Candidates: stages 1-3; the optimizer on the device, offloaded, and
(stage 3) the parameters offloaded too; given the machine's NVMe bytes, the NVMe tiers as well
(the optimizer on disk at stages 2 and 3, and the parameters too at stage 3); with and without activation checkpointing of the given module
classes; the given micro-batch sizes. A layout that does not fit at one micro-batch is not tried at a
larger one. With ``tensor_sizes``/``pipeline_sizes``, every layout also at each tensor- and
pipeline-parallel size whose product divides the world (stage 3 left out beside either, as the strategy
refuses it); a size the model cannot be split by (heads, vocabulary, layers) is reported, not planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_zero.config import ActivationCheckpointConfig, NvmeConfig, OffloadConfig, ZeroConfig
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig
from lightning_zero.plan.core import Plan, plan
from lightning_zero.plan.machine import Machine
from lightning_zero.plan.timing import StepTime

#: (stage, offload optimizer, offload parameters)
LAYOUTS: list[tuple[int, bool | str, bool | str]] = [
    (1, False, False),
    (2, False, False),
    (3, False, False),
    (2, True, False),
    (3, True, False),
    (3, True, True),
]
#: tried when the machine has NVMe bytes (``nvme_memory``)
NVME_LAYOUTS: list[tuple[int, bool | str, bool | str]] = [(2, "nvme", False), (3, "nvme", False), (3, "nvme", "nvme")]


@dataclass(frozen=True)
class Candidate:
    """One layout, its plan and its predicted step."""

    stage: int
    offload_optimizer: bool | str
    offload_parameters: bool | str
    checkpointing: bool
    micro_batch: int
    plan: Plan
    time: StepTime
    fits: bool
    """Device peak within the device memory, host total within the host memory (each with the NVMe
    tiers' staging buffers where they live), swap files within the NVMe bytes."""
    tensor: int = 1
    pipeline: int = 1

    @property
    def samples_per_second(self) -> float:
        """Micro-batches (with a pipeline: batches) of all data-parallel replicas per second."""
        replicas = self.plan.parallel.data if self.plan.parallel is not None else self.plan.world_size
        return self.micro_batch * replicas / self.time.seconds

    def describe(self) -> str:
        """The layout as strategy options."""
        offload = "+".join(
            n + (":nvme" if on == "nvme" else "")
            for n, on in (("optimizer", self.offload_optimizer), ("parameters", self.offload_parameters))
            if on
        )
        parallel = f"tp={self.tensor} pp={self.pipeline} " if (self.tensor, self.pipeline) != (1, 1) else ""
        return (
            f"{parallel}stage={self.stage} offload={offload or 'none'} "
            f"checkpointing={'on' if self.checkpointing else 'off'} micro_batch={self.micro_batch}"
        )


def search(
    model: str,
    world_size: int,
    machine: Machine,
    *,
    device_memory: int,
    host_memory: int,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    checkpoint_policy: Any = None,
    make_inputs: Callable[[int], Any] | None = None,
    nvme_memory: int = 0,
    nvme: NvmeConfig | None = None,
    tensor_sizes: Sequence[int] = (1,),
    pipeline_sizes: Sequence[int] = (1,),
    refused: list[str] | None = None,
    **plan_kwargs: Any,
) -> list[Candidate]:
    """Every candidate layout, those that fit first, each group by predicted samples/s (the
    recommended layout first). ``device_memory``/``host_memory``: bytes per rank and per rank's share
    of the host. ``checkpoint_policy``: activation checkpointing's policy to try besides none.
    ``make_inputs(micro_batch)``: the forward's input specs (default: the plan's, from ``micro_batch``).
    ``nvme_memory``: bytes of NVMe per rank; when positive the NVMe tiers are tried too, with the I/O
    knobs of ``nvme`` (its path is not written to). ``tensor_sizes``/``pipeline_sizes``: T and P to
    try (``tensor``/``pipeline`` in ``plan_kwargs`` give the other options of each: the plan,
    micro-batches, schedule); the reason a size cannot split the model is appended to ``refused``.
    Other keyword arguments go to :func:`~.core.plan` (``precision``, ``device``, ``seq_len``, ...)."""
    if device_memory <= 0 or host_memory <= 0 or nvme_memory < 0:
        raise ValueError(
            f"device_memory={device_memory} and host_memory={host_memory} must be positive bytes, "
            f"nvme_memory={nvme_memory} >= 0."
        )
    limits = _Limits(device_memory, host_memory, nvme_memory, nvme or NvmeConfig(path="nvme"))
    if not micro_batches or min(micro_batches) < 1:
        raise ValueError(f"micro_batches={list(micro_batches)} must be sizes >= 1.")
    base_zero = plan_kwargs.pop("zero", None) or ZeroConfig()
    base_tensor = plan_kwargs.pop("tensor", None) or TensorParallelConfig()
    base_pipeline = plan_kwargs.pop("pipeline", None) or PipelineConfig()
    sizes = [
        (t, p) for t in sorted(set(tensor_sizes)) for p in sorted(set(pipeline_sizes)) if world_size % (t * p) == 0
    ]
    if not sizes:
        raise ValueError(
            f"no tensor size of {list(tensor_sizes)} times a pipeline size of {list(pipeline_sizes)} divides {world_size} ranks."
        )
    found: list[Candidate] = []
    for t, p in sizes:
        parallel = {
            "tensor": dataclasses.replace(
                base_tensor, size=t, sequence_parallel=base_tensor.sequence_parallel and t > 1
            ),
            "pipeline": dataclasses.replace(base_pipeline, stages=p, chunks=base_pipeline.chunks if p > 1 else 1),
        }
        try:
            found += _layouts(model, world_size, machine, limits, micro_batches, checkpoint_policy, make_inputs,
                              base_zero, parallel, plan_kwargs)  # fmt: skip
        except ValueError as error:
            if (t, p) == (1, 1):
                raise
            (refused if refused is not None else []).append(f"tp={t} pp={p}: {error}")
    return sorted(found, key=lambda c: (not c.fits, -c.samples_per_second))


@dataclass(frozen=True)
class _Limits:
    """What a layout must fit: bytes per rank of device, host and NVMe memory, and the disk tiers'
    settings to try the NVMe layouts with."""

    device: int
    host: int
    nvme: int
    disk: NvmeConfig


def _layouts(
    model: str,
    world_size: int,
    machine: Machine,
    limits: _Limits,
    micro_batches: Sequence[int],
    checkpoint_policy: Any,
    make_inputs: Callable[[int], Any] | None,
    base_zero: ZeroConfig,
    parallel: dict[str, Any],
    plan_kwargs: dict[str, Any],
) -> list[Candidate]:
    """The candidates of one tensor- and pipeline-parallel size."""
    model_parallel = parallel["tensor"].size * parallel["pipeline"].stages > 1
    found: list[Candidate] = []
    for stage, offload_optimizer, offload_parameters in LAYOUTS + (NVME_LAYOUTS if limits.nvme > 0 else []):
        if model_parallel and stage == 3:
            continue  # refused beside tensor or pipeline parallelism
        disk = limits.disk if offload_optimizer == "nvme" else None
        for checkpointing in (False, True) if checkpoint_policy is not None else (False,):
            for micro_batch in sorted(micro_batches):
                extra = {"inputs": make_inputs(micro_batch)} if make_inputs else {"micro_batch": micro_batch}
                zero = dataclasses.replace(base_zero, stage=stage)
                p = plan(
                    model,
                    world_size,
                    zero=zero,
                    offload=OffloadConfig(
                        offload_optimizer=offload_optimizer, offload_parameters=offload_parameters, nvme=disk
                    ),
                    activations=ActivationCheckpointConfig(policy=checkpoint_policy if checkpointing else None),
                    **parallel,
                    **extra,
                    **plan_kwargs,
                )
                stages = p.parallel.stages if p.parallel is not None else (p,)
                host = max(q.total("host") for q in stages) if p.device == "cuda" else 0
                staging = p.nvme.staging_bytes if p.nvme is not None else 0  # host memory: the device's on a CPU rank
                peak = p.peak + (staging if p.device == "cpu" else 0)
                host += staging if p.device == "cuda" else 0
                fits = peak <= limits.device and host <= limits.host and p.nvme_bytes <= limits.nvme
                found.append(
                    Candidate(
                        stage,
                        offload_optimizer,
                        offload_parameters,
                        checkpointing,
                        micro_batch,
                        p,
                        p.step_time(machine),
                        fits,
                        parallel["tensor"].size,
                        parallel["pipeline"].stages,
                    )
                )
                if not fits:
                    break  # a larger micro-batch needs more memory still
    return found


def format_search(candidates: Sequence[Candidate]) -> str:
    """The search as a table, the recommended layout first."""
    lines = [
        f"{'':2}{'layout':84} {'peak MiB':>10} {'host MiB':>10} {'NVMe MiB':>10} {'step ms':>9} {'samples/s':>10}  fits"
    ]
    for i, c in enumerate(candidates):
        mark = "* " if i == 0 and c.fits else "  "
        lines.append(
            f"{mark}{c.describe():84} {c.plan.peak / 2**20:10.1f} {c.plan.total('host') / 2**20:10.1f} "
            f"{c.plan.nvme_bytes / 2**20:10.1f} "
            f"{c.time.seconds * 1e3:9.2f} {c.samples_per_second:10.2f}  {'yes' if c.fits else 'no'}"
        )
    if not any(c.fits for c in candidates):
        tiers = "" if any(c.plan.nvme is not None for c in candidates) else ", or the NVMe tiers (--nvme GiB)"
        lines.append(f"no layout fits: more ranks or a smaller micro-batch are left{tiers}")
    return "\n".join(lines)
