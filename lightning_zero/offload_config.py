"""The offload section of :class:`~lightning_zero.config.StrategyConfig`: what ZeRO-Offload moves off the
device (:class:`OffloadConfig`) and ZeRO-Infinity's disk tier (:class:`NvmeConfig`), validated where they
are built. Also importable from :mod:`lightning_zero.config`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightning_zero.option_fields import Keyword, integral, option


def _nvme_field(path: str | None, knobs: Mapping[str, object] | None) -> NvmeConfig | None:
    """``OffloadConfig.nvme`` from ``nvme_path`` and ``nvme_config``."""
    return nvme_config(None if path is None else str(path), knobs)


_NVME_KNOBS = Keyword(
    name="nvme_config",
    accepts="dict[str, Any] | None",
    given=None,
    doc="The disk tier's I/O knobs, a dict of ``block_size``, ``queue_depth``, ``aio_engine``, ``threads``, "
    "``buffer_count``, ``param_buffer_count``, ``direct_io``, ``restore_after_fit`` (:class:`NvmeConfig`); "
    "with ``nvme_path``.",
)


OFFLOAD_TIERS = ("cpu", "nvme")
"""Where offloaded tensors live: host memory, or files under ``NvmeConfig.path`` (ZeRO-Infinity)."""


def _tier(name: str, value: bool | str) -> str | None:
    """``False`` -> None, ``True``/"cpu" -> "cpu", "nvme" -> "nvme"; anything else is a ValueError."""
    if isinstance(value, bool):
        return "cpu" if value else None
    if value in OFFLOAD_TIERS:
        return value
    raise ValueError(f"{name}={value!r} must be True/False, 'cpu' (host memory, as True) or 'nvme' (files).")


def _positive_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"nvme {name}={value!r} must be an integer from {low} to {high}.")


AIO_ENGINES = ("auto", "io_uring", "threads", "python")
"""The values of :attr:`NvmeConfig.aio_engine`."""


@dataclass(frozen=True, kw_only=True)
class NvmeConfig:
    """ZeRO-Infinity's disk tier (:mod:`lightning_zero.offload.nvme`), DeepSpeed's ``offload_*`` /
    ``aio`` knobs in one place. Each rank keeps its files in ``<path>/lightning_zero-rank<r>``."""

    path: str
    """A directory on a fast local disk (an NVMe drive); created if missing."""

    block_size: int = 1 << 20
    """Bytes per read/write request (DeepSpeed ``aio.block_size``); a power of two, 4 KiB to 64 MiB
    (O_DIRECT needs multiples of the 4 KiB logical block)."""

    queue_depth: int = 32
    """Requests in flight per file operation (DeepSpeed ``aio.queue_depth``), 1 to 1024: the depth
    of the io_uring engine's ring (the thread-pool engines have ``threads`` requests in flight).
    32 with ``threads`` 4 (DeepSpeed's defaults are 8 and 1): the 3.3B capacity step (docs/benchmarks.md, "NVMe offload") took
    51 s against 62-66 s with 8 and 2 on the same virtio disk, which reads ~1.6x faster with
    several requests in flight than one at a time (as NVMe drives do)."""

    aio_engine: str = "auto"
    """The I/O engine (:mod:`lightning_zero.offload.nvme`): "io_uring" (compiled, ``queue_depth``
    requests in flight from one thread), "threads" (compiled, ``threads`` threads with
    pread/pwrite), "python" (the readable reference: Python threads, page cache), or "auto" (the
    first of these that works here). An engine that is not available falls back to the next with
    a one-time warning, never an error (containers often block io_uring)."""

    threads: int = 4
    """I/O threads (DeepSpeed ``aio.thread_count`` / ``intra_op_parallelism``), 1 to 64: the
    store's workers per direction (reads and writes each have this many), each moving one tensor
    (and, under the "threads" engine, this many C++ threads per tensor); they wait on the disk, not
    on the CPU."""

    buffer_count: int = 3
    """The step's depth of I/O per direction (DeepSpeed ``buffer_count``), 2 to 64: the sub-groups
    read ``buffer_count - 1`` ahead of the one being stepped and as many written behind it, so up
    to ``2 * buffer_count - 1`` sub-groups' masters and moments are in memory at once (and up to
    ``buffer_count`` gradient slices being written in backward). 3 (was 2): the 3.3B capacity step
    on this project's 2-core machine took 30.6-32.3 s against 33.3-38.9 s, its optimizer phase at
    0.94 of what the disk moves with reads and writes in flight together, for ~0.8 GiB more peak
    RSS (docs/benchmarks.md, "NVMe offload")."""

    param_buffer_count: int = 4
    """Stage-3 parameter shards in memory at once under ``offload_parameters="nvme"`` (DeepSpeed
    ``offload_param.buffer_count``): the shards read ahead of the gathers that need them, 1 to 64
    (plus the one being gathered and, during the step, the one being written behind)."""

    direct_io: bool = True
    """O_DIRECT (bypass the page cache) in the compiled engine where the file system allows it (the
    Python fallback always goes through the page cache)."""

    restore_after_fit: bool | None = None
    """What the end of a finished fit brings back into host memory before the files are removed.
    True: the optimizer states (so ``trainer.save_checkpoint`` after fit still works) and, at stage
    3, the whole model (each parameter gathered for good, usable after fit). False: nothing; the
    files are removed unread, stage-3 parameters stay released (empty tensors, or this rank's piece)
    and saving after fit is a ValueError: a model whose training state does not fit in RAM, the
    reason for the disk tier, saves its checkpoints during fit (``ModelCheckpoint``) and gets its
    weights from them (``lightning_zero.checkpoint.consolidate``). None (default): False when the
    parameters are on disk (``offload_parameters="nvme"``: gathering the whole model at the end of
    fit would need the RAM the tier exists to avoid), else True."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"nvme_path={self.path!r} must be a directory path (a string), e.g. '/local_nvme'.")
        for name in ("block_size", "queue_depth", "threads", "buffer_count", "param_buffer_count"):
            integral(self, name)  # 1.048576e6 from a YAML file is the integer
        _positive_int("block_size", self.block_size, 4096, 64 << 20)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"nvme block_size={self.block_size} must be a power of two (O_DIRECT alignment), e.g. {1 << 20}."
            )
        _positive_int("queue_depth", self.queue_depth, 1, 1024)
        _positive_int("threads", self.threads, 1, 64)
        _positive_int("buffer_count", self.buffer_count, 2, 64)
        _positive_int("param_buffer_count", self.param_buffer_count, 1, 64)
        if self.aio_engine not in AIO_ENGINES:
            raise ValueError(f"nvme aio_engine={self.aio_engine!r} must be one of {list(AIO_ENGINES)}.")
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"nvme direct_io={self.direct_io!r} must be True or False.")
        if self.restore_after_fit is not None and not isinstance(self.restore_after_fit, bool):
            raise ValueError(f"nvme restore_after_fit={self.restore_after_fit!r} must be True, False or None (auto).")


def nvme_config(path: str | None, knobs: Mapping[str, object] | None) -> NvmeConfig | None:
    """The :class:`NvmeConfig` of ``ZeroStrategy(nvme_path=..., nvme_config={...})``; None without a path."""
    if path is None:
        if knobs:
            raise ValueError(f"nvme_config={dict(knobs)!r} was given without nvme_path; set nvme_path to a directory.")
        return None
    allowed = (
        "block_size",
        "queue_depth",
        "threads",
        "buffer_count",
        "param_buffer_count",
        "direct_io",
        "restore_after_fit",
        "aio_engine",
    )
    unknown = sorted(set(knobs or {}) - set(allowed))
    if unknown:
        raise ValueError(f"nvme_config has unknown keys {unknown}; the knobs are {list(allowed)}.")
    return NvmeConfig(path=str(path), **dict(knobs or {}))  # type: ignore[arg-type]  # each knob is checked in __post_init__


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What ZeRO-Offload moves from the device to host memory (or, ZeRO-Infinity, to disk)."""

    offload_optimizer: bool | str = option(False)
    """fp32 master weights, gradient slices and optimizer states off the device; the optimizer step
    runs on the CPU (``lightning_zero.ops`` kernels) and writes the 16-bit parameters back. ``True``
    or "cpu": in host memory; "nvme": masters and states in files under ``nvme.path``, streamed
    through host memory one sub-group at a time during the step."""

    offload_parameters: bool | str = option(False)
    """Stage 3 only: parameter shards in host memory too, gathered to the device when a module
    needs them. Requires ``offload_optimizer``. "nvme" (ZeRO-Infinity, with ``offload_optimizer="nvme"``):
    the shards rest in files under ``nvme.path``, read ahead of the gathers that need them and
    written back after the step (:class:`lightning_zero.zero.swap.ParamTier`)."""

    pin_memory: bool = option(True)
    """Page-lock host buffers when the device is a GPU, so copies run asynchronously at full speed."""

    nvme: NvmeConfig | None = option(
        None,
        name="nvme_path",
        accepts="str | None",
        note="``nvme_path``: its directory, on a fast local drive (the knobs: ``nvme_config``).",
        to_field=_nvme_field,
        also=(_NVME_KNOBS,),
    )
    """The disk tier's path and I/O knobs; required when either tier is "nvme"."""

    pipeline: bool = option(True, name="offload_pipeline")
    """DeepSpeed's pipelined offload: when the compiled kernels step the slices, each bucket's 16-bit
    copy-back (on a GPU: its host-to-device copy, on a side stream) and all-gather start as soon as
    it is stepped, while the next bucket steps; False steps every bucket first, then publishes.
    Same numbers either way (bitwise)."""

    def __post_init__(self) -> None:
        optimizer_tier = _tier("offload_optimizer", self.offload_optimizer)
        parameter_tier = _tier("offload_parameters", self.offload_parameters)
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory={self.pin_memory!r} must be True or False.")
        if not isinstance(self.pipeline, bool):
            raise ValueError(f"offload_pipeline={self.pipeline!r} must be True or False.")
        if parameter_tier and not optimizer_tier:
            raise ValueError(
                f"offload_parameters={self.offload_parameters!r} needs offload_optimizer=True: parameter shards off "
                "the device are updated by the CPU optimizer step. Set both (as DeepSpeed's zero3_offload does)."
            )
        if parameter_tier == "nvme" and optimizer_tier != "nvme":
            raise ValueError(
                f"offload_parameters='nvme' with offload_optimizer={self.offload_optimizer!r}: parameter shards on "
                "disk are stepped from disk too; set offload_optimizer='nvme'."
            )
        uses_nvme = "nvme" in (optimizer_tier, parameter_tier)
        if uses_nvme and self.nvme is None:
            raise ValueError(
                "offload_optimizer='nvme' / offload_parameters='nvme' need nvme_path: the directory (on a fast local "
                "disk) where each rank keeps its swap files, e.g. ZeroStrategy(..., nvme_path='/local_nvme')."
            )
        if self.nvme is not None and not isinstance(self.nvme, NvmeConfig):
            raise ValueError(f"nvme={self.nvme!r} must be a lightning_zero.config.NvmeConfig or None.")

    @property
    def optimizer_tier(self) -> str | None:
        """None (on the device), "cpu" or "nvme"."""
        return _tier("offload_optimizer", self.offload_optimizer)

    @property
    def parameter_tier(self) -> str | None:
        """None (on the device), "cpu" or "nvme"."""
        return _tier("offload_parameters", self.offload_parameters)
