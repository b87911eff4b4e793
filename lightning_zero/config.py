"""Validated configuration objects, one per concern, composed into one :class:`StrategyConfig`.

Every option a user can set lives in a frozen, keyword-only dataclass whose ``__post_init__`` raises
``ValueError`` naming the bad value and the fix, so bad input fails at construction, before any
process group or tensor exists. Checks within one concern live in its section; checks across
sections (offloaded parameters need stage 3, model parallelism needs stage 1 or 2) live in
:class:`StrategyConfig` only. ``ZeroStrategy``'s keyword arguments build it once; the sections are
passed down whole; nothing unpacks them into long argument lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch

from lightning_zero.ddp_args import DataParallelConfig

# the offload section lives in offload_config.py; these names stay importable from here
from lightning_zero.offload_config import AIO_ENGINES as AIO_ENGINES
from lightning_zero.offload_config import OFFLOAD_TIERS as OFFLOAD_TIERS
from lightning_zero.offload_config import NvmeConfig as NvmeConfig
from lightning_zero.offload_config import OffloadConfig
from lightning_zero.offload_config import nvme_config as nvme_config
from lightning_zero.option_fields import OMIT, integral, option
from lightning_zero.parallel_config import PipelineConfig, TensorParallelConfig

#: Precision strings accepted by :class:`~lightning_zero.OffloadPrecision`, with the dtype that
#: parameters and gradients have under ZeRO and whether an fp32 master copy is kept.
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "32-true": (torch.float32, False),
    "bf16-mixed": (torch.bfloat16, True),
    "16-mixed": (torch.float16, True),
    "bf16-true": (torch.bfloat16, False),
    "64-true": (torch.float64, False),
}

# Lightning spells some precisions in short forms; they mean the same thing.
_PRECISION_ALIASES = {
    "64": "64-true",
    64: "64-true",
    "32": "32-true",
    32: "32-true",
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
}


def _default_if_none(value: object) -> object:
    """A keyword whose ``None`` means the field's default (``timeout=None``: 10 minutes)."""
    return OMIT if value is None else value


def _debug_from_env(value: bool | None) -> bool:
    """``debug_collectives=None``: the ``LIGHTNING_ZERO_DEBUG_COLLECTIVES`` environment variable."""
    from lightning_zero import debug  # (debug needs comm, which config does not)

    return debug.debug_from_env() if value is None else value


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


def normalize_precision(precision: str | int) -> str:
    """Map Lightning's precision spellings onto the :data:`PRECISIONS` keys.

    Raises:
        ValueError: for a precision ZeRO does not support here (e.g. "16-true", "transformer-engine").
    """
    key = _PRECISION_ALIASES.get(precision, precision)
    if key not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by lightning_zero; use one of "
            f"{sorted(PRECISIONS)} (for fp16 parameters with fp32 master weights use '16-mixed')."
        )
    return str(key)


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


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Dynamic loss scaling for "16-mixed" (fp16 gradients overflow without it)."""

    initial_scale: float = 2.0**16
    """Scale of the first step."""

    growth_factor: float = 2.0
    """Multiply the scale by this after ``growth_interval`` steps without overflow."""

    backoff_factor: float = 0.5
    """Multiply the scale by this when a step overflows (the step is skipped)."""

    growth_interval: int = 1000
    """Consecutive finite steps before the scale grows."""

    min_scale: float = 1.0
    """The scale never drops below this; reaching it repeatedly means the model diverges."""

    def __post_init__(self) -> None:
        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number (see the defaults: 2**16, 2.0, 0.5, 1.0).")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise ValueError(
                f"growth_interval={self.growth_interval!r} must be a whole number of steps (usually 1000)."
            )
        if not self.initial_scale > 0:
            raise ValueError(f"initial_scale={self.initial_scale} must be > 0 (DeepSpeed's default is 2**16).")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor={self.growth_factor} must be > 1 (usually 2.0).")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor={self.backoff_factor} must be in (0, 1) (usually 0.5).")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval={self.growth_interval} must be >= 1 (usually 1000).")
        if not 0 < self.min_scale <= self.initial_scale:
            raise ValueError(f"min_scale={self.min_scale} must be in (0, initial_scale={self.initial_scale}].")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How ``trainer.save_checkpoint`` writes (the names of Lightning's ``FSDPStrategy``).

    ``"sharded"`` (default): a directory, every rank writing its own shards in parallel; no rank
    gathers anything, and it loads at any world size and layout. ``"full"``: one ordinary Lightning
    checkpoint file written by rank 0 (the whole model and the optimizer states as torch writes them,
    gathered tensor by tensor from a sharded save), which ``torch.load``, ``load_from_checkpoint``,
    DDP and a single process read; it costs rank 0 host memory for the whole checkpoint.
    """

    state_dict_type: str = option("sharded")
    """"sharded" (a directory of per-rank shards) or "full" (one Lightning checkpoint file from rank 0)."""

    async_save: bool = option(False)
    """Asynchronous save (sharded only): during ``fit`` a save copies this rank's shards into host
    memory and returns; a background thread writes them, and the checkpoint is published (renamed
    into place) at the first step boundary after every rank's writer finished, or at the next save,
    removal or load, or at the end of fit. A failed background write raises on every rank there. Costs
    host memory for one copy of this rank's shards (:mod:`lightning_zero.checkpoint.save`)."""

    node_local_storage: bool = option(False)
    """Node-local checkpoints (DeepSpeed's ``use_node_local_storage``), sharded only, local paths only:
    each node writes its own ranks' files under the checkpoint path *as that node resolves it* (a
    node-local disk such as ``/local_ssd/ck``), with ``lightning.pt``, ``metadata.json`` and the tensors
    ZeRO does not partition written once per node, so each node's directory is enough for its own
    ranks to resume (same world size and layout). ``lightning-zero consolidate`` takes the nodes'
    directories together (:mod:`lightning_zero.checkpoint.io`). Without it every rank writes under rank
    0's directory, which all nodes must see."""

    def __post_init__(self) -> None:
        if not isinstance(self.node_local_storage, bool):
            raise ValueError(f"node_local_storage={self.node_local_storage!r} must be True or False.")
        if self.node_local_storage and self.state_dict_type != "sharded":
            raise ValueError(
                f"node_local_storage=True with state_dict_type={self.state_dict_type!r}: a full checkpoint is one "
                "file that rank 0 assembles from every rank's shards, which it cannot read from other nodes' disks. "
                "Use state_dict_type='sharded' (and `lightning-zero consolidate` over the nodes' directories for one "
                "file), or node_local_storage=False with a shared filesystem."
            )
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r}; use 'sharded' (a directory, every rank writes its "
                "shards) or 'full' (one Lightning checkpoint file from rank 0)."
            )
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError(
                f"async_save=True with state_dict_type={self.state_dict_type!r}: only sharded saves are written in "
                "the background (a full checkpoint is assembled on rank 0 from a sharded one). Use "
                "state_dict_type='sharded', or async_save=False."
            )


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How a run notices a lost or stuck rank (see :mod:`lightning_zero.failures`)."""

    timeout: timedelta | int | float = option(
        timedelta(minutes=10),
        accepts="timedelta | float | None",
        given=None,
        note="``None``: 10 minutes.",
        to_field=_default_if_none,
    )
    """Longest wait in one collective before it fails (a ``timedelta``, or seconds). A rank that dies
    closes its connections and gloo fails at once; the timeout bounds the silent cases (a host that
    vanished, a rank stuck in a loop, NCCL). Lightning's default is 30 minutes; raise this if a step,
    a validation loop or a checkpoint save on one rank can keep the others waiting longer."""

    debug_collectives: bool = option(
        False,
        accepts="bool | None",
        given=None,
        note="``None`` reads ``LIGHTNING_ZERO_DEBUG_COLLECTIVES``.",
        to_field=_debug_from_env,
    )
    """Compare every collective across ranks before issuing it (:mod:`lightning_zero.debug`)."""

    @property
    def collective_timeout(self) -> timedelta:
        """``timeout`` as a ``timedelta`` (a number of seconds is converted at construction)."""
        assert isinstance(self.timeout, timedelta)
        return self.timeout

    def __post_init__(self) -> None:
        timeout = self.timeout
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout):
            normalized = timedelta(seconds=timeout)
            object.__setattr__(self, "timeout", normalized)  # frozen: normalize once here
        elif isinstance(timeout, timedelta):
            normalized = timeout
        else:
            raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta or a number of seconds (e.g. 600).")
        if normalized <= timedelta(0):
            raise ValueError(f"timeout={timeout!r} must be positive; the default is 10 minutes (600 s).")
        if not isinstance(self.debug_collectives, bool):
            raise ValueError(f"debug_collectives={self.debug_collectives!r} must be True or False.")


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointConfig:
    """Activation checkpointing (see :mod:`lightning_zero.activations`), named like Lightning's
    ``FSDPStrategy(activation_checkpointing_policy=...)``."""

    policy: Any = option(None, name="activation_checkpointing")
    """Which submodules recompute their forward in backward instead of keeping its activations:
    ``None`` (none), a module class, a set/list/tuple of classes (every instance of them), or a
    callable ``policy(module) -> bool`` asked for every submodule (not the LightningModule itself)."""

    offload: bool = option(False, name="activation_checkpointing_offload")
    """Keep the checkpointed modules' inputs in host memory until backward (accelerators only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.offload, bool):
            raise ValueError(f"activation_checkpointing_offload={self.offload!r} must be True or False.")
        if self.offload and self.policy is None:
            raise ValueError(
                "activation_checkpointing_offload=True keeps the checkpointed activations on the host, but "
                "activation_checkpointing is None: nothing is checkpointed. Give activation_checkpointing too."
            )
        policy = self.policy
        if policy is None or (isinstance(policy, type) and issubclass(policy, torch.nn.Module)):
            return
        if isinstance(policy, (set, frozenset, list, tuple)):
            bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, torch.nn.Module))]
            if bad or not policy:
                raise ValueError(
                    f"activation_checkpointing={policy!r}: a collection must hold torch.nn.Module subclasses "
                    f"(not {bad!r}), e.g. {{nn.TransformerEncoderLayer}}; use None to turn checkpointing off."
                )
            object.__setattr__(self, "policy", frozenset(policy))  # frozen: normalize once here
            return
        if isinstance(policy, type) or not callable(policy):
            raise ValueError(
                f"activation_checkpointing={policy!r} must be None, an nn.Module subclass, a set of them, or a "
                "callable module -> bool (e.g. lambda m: isinstance(m, Block))."
            )

    def selects(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is checkpointed under this policy."""
        if self.policy is None:
            return False
        if isinstance(self.policy, frozenset):
            return isinstance(module, tuple(self.policy))
        if isinstance(self.policy, type):
            return isinstance(module, self.policy)
        return bool(self.policy(module))


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """Every option of one :class:`~lightning_zero.ZeroStrategy`, by section, with the checks that
    span sections. Built once from the strategy's keyword arguments."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    tensor: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activations: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)

    def __post_init__(self) -> None:
        stage = self.zero.stage
        if self.data_parallel.bucket_cap_mb is not None and self.zero.reduce_bucket_size != "auto":
            raise ValueError(
                f"bucket_cap_mb={self.data_parallel.bucket_cap_mb} and reduce_bucket_size="
                f"{self.zero.reduce_bucket_size!r} both set the gradient bucket size; give one of them "
                "(bucket_cap_mb in MiB as DDP, reduce_bucket_size in elements as DeepSpeed)."
            )
        if self.offload.offload_parameters and stage != 3:
            raise ValueError(
                f"offload_parameters={self.offload.offload_parameters!r} shards parameters into host memory, which "
                f"needs stage=3 (got stage={stage}); "
                "use stage=3, or offload_optimizer=True alone."
            )
        if self.tensor.size > 1 and stage == 3:
            raise ValueError(
                f"tensor_parallel_size={self.tensor.size} with stage=3 is not supported: stage 3 builds models on the "
                "meta device, which cannot be split by a plan before it is materialized; use stage=1 or stage=2"
            )
        if self.pipeline.stages > 1 and stage == 3:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline.stages} with stage=3 is not supported: stage 3 would all-gather "
                "every layer's parameters again for each micro-batch's forward and backward (2m gathers per step), "
                "while the pipeline already divides parameters by the number of stages; use stage=1 (fewest "
                "collectives, as DeepSpeed's pipeline) or stage=2"
            )
