"""The ZeRO section of :class:`~lightning_zero.config.StrategyConfig` (:class:`ZeroConfig`: what is
sharded, bucket sizes, the reduce dtype, the non-finite policy), validated where it is built, and the
sizes it resolves for a model (``"auto"``). Also importable from :mod:`lightning_zero.config`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_zero.option_fields import integral, option

#: ``reduce_dtype`` spellings (YAML strings and torch dtypes) -> the dtype gradients are reduced and kept in
REDUCE_DTYPES: dict[Any, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    torch.float32: torch.float32,
    torch.bfloat16: torch.bfloat16,
    torch.float16: torch.float16,
}


def grad_dtype(reduce_dtype: str | torch.dtype | None, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of gradient buckets and reduced slices: ``reduce_dtype`` (validated by
    :class:`ZeroConfig`), or the compute dtype when it is ``None``.

    Raises:
        ValueError: a ``reduce_dtype`` under "64-true", whose gradients are float64 (rounding them
            would make ZeRO diverge from DDP there; leave ``reduce_dtype=None``).
    """
    if reduce_dtype is None:
        return compute_dtype
    if compute_dtype == torch.float64:
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r} under precision='64-true' would round float64 gradients; "
            "leave reduce_dtype=None there (gradients are reduced in float64)."
        )
    return REDUCE_DTYPES[reduce_dtype]


#: options that take ``"auto"`` (:meth:`ZeroConfig.sized_for`) and its bounds, in elements
AUTO_SIZED = ("reduce_bucket_size", "prefetch_bucket_size")
AUTO_BUCKET_MIN, AUTO_BUCKET_MAX = 1 << 18, 5_000_000


#: ZeroConfig's options counted in elements or bytes: an integral float (``5e8``) is taken as the integer
ELEMENT_COUNTS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "prefetch_bucket_size",
    "max_live_parameters",
    "param_persistence_threshold",
    "host_mmap_threshold",
)


def _resolved(name: str, value: int | str) -> int:
    if isinstance(value, str):
        raise RuntimeError(
            f'{name}="auto" is resolved when the engine is built (ZeroConfig.sized_for); call that first.'
        )
    return value


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """What ZeRO shards and how gradients and parameters move between ranks."""

    stage: int = option(2)
    """1: shard fp32 master weights and optimizer states; 2: also gradients; 3: also parameters."""

    reduce_bucket_size: int | str = option("auto", accepts="int | float | str")
    """Elements per gradient bucket (one flat buffer, one reduce-scatter). Larger buckets mean
    fewer, more efficient collectives and more transient memory; smaller ones start reducing earlier
    in backward (with one bucket larger than the model nothing overlaps). ``"auto"``: 5M (DeepSpeed's
    default) for models of 80M parameters and more, a sixteenth of the model below that (at least
    262,144): see :meth:`sized_for`."""

    allgather_bucket_size: int = option(50_000_000, accepts="int | float")
    """Most elements of updated-parameter all-gathers in flight at once after the step (stage 1/2).
    Bounds the communication issued back to back; it does not copy through extra buffers."""

    overlap_comm: bool = option(True)
    """Stages 2/3: launch a bucket's reduction as soon as it is full, during backward (asynchronously;
    on a GPU on a side stream). False reduces everything after backward: easier to debug, slower.
    Stage 1 always reduces once, at the accumulation boundary."""

    prefetch_bucket_size: int | str = option(5_000_000, accepts="int | float | str")
    """Stage 3: most elements of parameters all-gathered ahead of the module that needs them, along
    the execution order recorded on the previous step. Every prefetched element is resident until
    its module ran: the default keeps about one large layer ahead (DeepSpeed's default, 50M, keeps
    all of a 34M-parameter model gathered in forward: measured +113 MiB per rank in fp32).
    ``"auto"`` sizes it as ``reduce_bucket_size``: less memory on small models, less overlap (the
    13.8M benchmark GPT at stage 3: peak RSS 330 -> 317 MiB per rank, step 1.24 -> 1.33x DDP)."""

    param_persistence_threshold: int = option(100_000, accepts="int | float")
    """Stage 3: parameters with at most this many elements stay whole on every rank (sharded only in
    their optimizer states and gradients, as in stage 2): gathering them costs more than they save."""

    max_live_parameters: int = option(1_000_000_000, accepts="int | float")
    """Stage 3: prefetching stops while this many elements of full parameters are gathered."""

    gather_units: tuple[type | str, ...] = option((), accepts="Sequence[type | str]", to_field=tuple)
    """Stage 3: modules gathered whole (their subtree's parameters) before their forward, besides the
    default ones (a Hugging Face model's ``_no_split_modules`` blocks, ``nn.MultiheadAttention``, RNN
    modules, PEFT's LoRA layers): module classes, class names, or qualified module names as
    ``named_modules()`` prints them (``fnmatch`` patterns, e.g. ``"model.layers.*"``). FSDP's
    ``auto_wrap_policy``, DeepSpeed's ``set_z3_leaf_modules``. A unit's whole subtree is gathered at
    once: the gather window is the largest unit plus ``prefetch_bucket_size`` elements ahead."""

    host_mmap_threshold: int | None = option(1 << 20, accepts="int | float | None")
    """CPU training (and host memory under offload), glibc only: host allocations of at least this
    many bytes are served from ``mmap`` and returned to the OS when freed, set at setup and put back
    at teardown (:func:`lightning_zero.memory.fix_mmap_threshold`). Keeps the resident set the OS
    reports near the live bytes instead of glibc's fragmented heap (measured 378 vs 503 MiB peak RSS
    growth per rank at stage 3 on 34M fp32 parameters). ``None`` leaves the allocator alone; an
    environment variable ``MALLOC_MMAP_THRESHOLD_`` set by the user also does."""

    reduce_dtype: str | torch.dtype | None = option(None)
    """The dtype gradients are collected, reduced and kept in between backward and the step: ``None``
    (the compute dtype: 16 bits under "bf16-mixed" / "16-mixed", the 2 bytes per parameter of the
    ZeRO formula, and half the bytes through the collectives), or "fp32" (FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``: sums over ranks and micro-steps in fp32,
    which is what Lightning's DDP does under "bf16-mixed"; costs 4 bytes per parameter in the
    buckets and the reduced slice). "bf16" / "fp16" under "32-true" halve the collective's bytes at
    the cost of rounding each gradient. Torch dtypes are accepted too."""

    on_nonfinite: str = option("error")
    """Non-finite (inf/NaN) gradients under "32-true", "bf16-mixed" or "bf16-true": "error" raises
    before the weights are touched, naming the step; "skip" skips the step with a warning and a
    counter; "ignore" does not check (saves a scalar all-reduce and a host sync per step). "16-mixed"
    always skips and lowers the loss scale instead."""

    allow_untested_optimizer: bool = option(False)
    """Accept an optimizer class that is not known to be elementwise. ZeRO steps each rank's flat
    slice independently, which is only exact for optimizers whose update of an element depends on
    that element alone (SGD, Adam, AdamW, ...)."""

    absorb_param_edits: bool = option(True)
    """Parameters edited in place outside the step (weight clipping in a hook, an EMA swapped in by
    a callback) keep the edit, as under DDP: before each step and each checkpoint, elements of this
    rank's whole-parameter slice that differ from the master are written into it. This is a pass
    over the slice (measured ~45 ms per 25M elements on 2 AVX2 cores, about one CPU AdamW step) and
    only runs where the master is a separate tensor (mixed precision, offload). False skips it: edits
    made outside ``gathered_parameters(modifier_rank=...)`` are then overwritten at the next step.
    Under the NVMe tier (``offload_optimizer="nvme"``) the masters are on disk between steps and the
    check runs only before a checkpoint."""

    expose_param_grads: bool | None = option(None)
    """Give user code DDP's ``param.grad`` where Lightning runs it. ``None`` (default): after each
    ``manual_backward`` in manual optimization (read-only, until the next backward, step or
    ``zero_grad``; an edit there warns; stage 3's sharded parameters hold this rank's piece of the
    weight there and get the same piece of the gradient), during a validation run that starts inside
    an accumulation window (the same read-only window), and in ``on_before_optimizer_step`` and
    ``configure_gradient_clipping`` when the LightningModule overrides either hook or a callback
    overrides ``on_before_optimizer_step`` (every stage: elementwise edits such as ``p.grad.clamp_`` or
    ``clip_grad_norm_`` reach the step; runs that read nothing there pay nothing). ``True``: in those
    two hooks always. ``False``: never (a warning at setup names the overridden hooks that would read
    ``None``; see :mod:`lightning_zero.exposure`). Each full exposure all-gathers the gradients and holds them at full
    size (fp32 under mixed precision: 4 bytes per parameter, plus 2 for the 16-bit ``.grad`` copies),
    the memory stage 2 exists to save; stage 3's pieces cost a slice-sized copy and no communication.
    On demand, wrap the code in ``strategy.full_gradients(module)`` instead
    (:mod:`lightning_zero.zero.grads`)."""

    def __post_init__(self) -> None:
        if self.stage == 0 and type(self.stage) is int:
            raise ValueError("stage=0 is not a ZeRO stage: it is plain data parallelism. Use strategy='ddp' instead.")
        if type(self.stage) is not int or self.stage not in (1, 2, 3):
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; choose 1, 2 or 3.")
        for name in ELEMENT_COUNTS:
            integral(self, name)  # 5e8, as DeepSpeed configs and YAML files write sizes
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters"):
            value = getattr(self, name)
            if value == "auto" and name in AUTO_SIZED:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                auto = ' or "auto" (sized to the model)' if name in AUTO_SIZED else ""
                raise ValueError(
                    f"{name}={value!r} must be a positive number of elements (e.g. 25_000_000, or 2.5e7: a whole "
                    f"number){auto}; smaller buckets use less memory, larger ones fewer collectives."
                )
        mmap = self.host_mmap_threshold
        if mmap is not None and (not isinstance(mmap, int) or isinstance(mmap, bool) or not 0 < mmap <= 1 << 40):
            raise ValueError(
                f"host_mmap_threshold={mmap!r} must be None (leave the allocator alone) or a number of bytes "
                "> 0, e.g. 1048576: host allocations at least that large are returned to the OS when freed."
            )
        if not isinstance(self.absorb_param_edits, bool):
            raise ValueError(f"absorb_param_edits={self.absorb_param_edits!r} must be True or False.")
        if self.expose_param_grads is not None and not isinstance(self.expose_param_grads, bool):
            raise ValueError(
                f"expose_param_grads={self.expose_param_grads!r} must be None (after manual_backward only), "
                "True or False."
            )
        if self.on_nonfinite not in ("error", "skip", "ignore"):
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r} must be 'error' (stop before the weights are touched), "
                "'skip' (skip the step with a warning) or 'ignore' (no check)."
            )
        units = self.gather_units
        if not isinstance(units, (tuple, list)) or not all(
            (isinstance(u, type) and issubclass(u, torch.nn.Module)) or (isinstance(u, str) and u) for u in units
        ):
            raise ValueError(
                f"gather_units={units!r} must be a list of nn.Module subclasses, class names or module names "
                "(e.g. [LlamaDecoderLayer] or ['model.layers.*'])."
            )
        object.__setattr__(self, "gather_units", tuple(units))
        threshold = self.param_persistence_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(
                f"param_persistence_threshold={threshold!r} must be an integer >= 0 (elements); 0 shards "
                "every parameter, DeepSpeed's default is 100_000."
            )
        if self.reduce_dtype is not None and (
            not isinstance(self.reduce_dtype, (str, torch.dtype)) or self.reduce_dtype not in REDUCE_DTYPES
        ):
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype!r} is not a gradient dtype ZeRO reduces in; use None (the "
                "compute dtype), 'fp32', 'bf16' or 'fp16' (or torch.float32 / torch.bfloat16 / torch.float16)."
            )
        for name in ("overlap_comm", "allow_untested_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")

    @property
    def reduce_bucket_numel(self) -> int:
        """``reduce_bucket_size`` once :meth:`sized_for` resolved it."""
        return _resolved("reduce_bucket_size", self.reduce_bucket_size)

    @property
    def prefetch_bucket_numel(self) -> int:
        """``prefetch_bucket_size`` once :meth:`sized_for` resolved it."""
        return _resolved("prefetch_bucket_size", self.prefetch_bucket_size)

    def sized_for(self, numel: int) -> ZeroConfig:
        """This config with its ``"auto"`` bucket sizes resolved for a model of ``numel`` parameters
        (the engine calls it once, at setup). 5M elements (DeepSpeed's default) from 80M parameters
        on; below, a sixteenth of the model, at least 262,144: buckets and the stage-3 prefetch window
        are transient memory on top of the ZeRO formula, and a fixed 5M is 36% of a 14M model (two
        buckets in flight are then 0.7 of its gradients: measured 36 MiB of pool blocks per rank on the
        13.8M benchmark GPT at stage 2, 20 MiB with 1M-element buckets)."""
        size = min(AUTO_BUCKET_MAX, max(AUTO_BUCKET_MIN, numel // 16))
        return replace(
            self,
            reduce_bucket_size=size if self.reduce_bucket_size == "auto" else self.reduce_bucket_size,
            prefetch_bucket_size=size if self.prefetch_bucket_size == "auto" else self.prefetch_bucket_size,
        )
