"""The tensor- and pipeline-parallel options (see :mod:`lightning_zero.parallel`): two sections of
:class:`lightning_zero.config.StrategyConfig`, validated where they are built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_zero.option_fields import option

PIPELINE_SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules by name (:mod:`lightning_zero.parallel.schedules` builds their actions)."""

PIPELINE_PARTITIONS = ("parameters", "uniform")
"""Ways to balance pipeline stages; ``"type:<regex>"`` (layers whose class name matches) also works."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallelism (see :mod:`lightning_zero.parallel.pipeline`)."""

    stages: int = option(1, name="pipeline_parallel_size")
    """P, the number of pipeline stages (``pipeline_parallel_size``); 1 turns pipelining off."""

    micro_batches: int | None = option(None, name="pipeline_micro_batches")
    """m, the micro-batches each training batch is split into (default: P). The idle fraction of
    each stage is (P - 1) / (m + P - 1), so m of 4P or more keeps the bubble under ~20%. A batch
    that m does not divide is cut into pieces whose sizes differ by one (losses weighted by rows)."""

    schedule: str = option("1f1b", name="pipeline_schedule")
    """"1f1b" (at most P - s micro-batches' activations alive on stage s) or "gpipe" (all m)."""

    chunks: int = option(1, name="pipeline_chunks")
    """v, chunks of layers per stage: above 1 the interleaved 1F1B schedule (virtual stage k on
    stage k % P) divides the bubble by about v for v times the messages; m must then be a
    multiple of P."""

    partition: str = option("parameters", name="pipeline_partition")
    """How layers are spread over stages: "parameters" (balance parameter counts), "uniform"
    (balance layer counts) or "type:<regex>" (balance the layers whose class name matches, e.g.
    "type:Block"; parameter counts break ties)."""

    def __post_init__(self) -> None:
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise ValueError(f"pipeline_parallel_size={self.stages!r} must be an integer of at least 1.")
        m = self.micro_batches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(
                f"pipeline_micro_batches={m!r} must be a positive integer (or None for the number of stages)."
            )
        v = self.chunks
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"pipeline_chunks={v!r} must be a positive integer (1: no interleaving).")
        if v > 1 and self.stages == 1:
            raise ValueError(
                f"pipeline_chunks={v} interleaves the chunks of a pipeline; it needs pipeline_parallel_size > 1."
            )
        if v > 1 and m is not None and m % self.stages:
            raise ValueError(
                f"pipeline_chunks={v} (interleaved 1F1B) runs micro-batches in groups of the {self.stages} stages: "
                f"pipeline_micro_batches={m} must be a multiple of {self.stages}."
            )
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule={self.schedule!r}; use one of {PIPELINE_SCHEDULES}.")
        if self.partition not in PIPELINE_PARTITIONS and not self.partition.startswith("type:"):
            raise ValueError(
                f"pipeline_partition={self.partition!r}; use one of {PIPELINE_PARTITIONS} or 'type:<regex>' "
                "(e.g. 'type:Block')."
            )

    @property
    def num_micro_batches(self) -> int:
        """m: the configured number, else one per stage."""
        return self.micro_batches if self.micro_batches is not None else self.stages


@dataclass(frozen=True, kw_only=True)
class TensorParallelConfig:
    """Tensor (and sequence) parallelism (see :mod:`lightning_zero.parallel.tensor`)."""

    size: int = option(1, name="tensor_parallel_size")
    """T, the ranks that split each layer Megatron-style (``tensor_parallel_size``); 1 turns it off."""

    plan: Mapping[str, str] | None = option(None, name="tensor_parallel_plan", accepts="dict[str, str] | None")
    """Module-name pattern -> "column" | "row" | "vocab" | "replicate" | "sequence" | ...; ``None``
    takes the LightningModule's ``tensor_parallel_plan`` (a method or an attribute)."""

    sequence_parallel: bool = option(False)
    """Megatron sequence parallelism between the tensor-parallel layers (:mod:`lightning_zero.parallel.sequence`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"tensor_parallel_size is {self.size!r}; it must be an integer of at least 1")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be True or False.")
        if self.sequence_parallel and self.size == 1:
            raise ValueError(
                "sequence_parallel=True splits the sequence over the tensor-parallel ranks; it needs "
                "tensor_parallel_size > 1 (got 1)"
            )
