"""``ZeroStrategy(config=...)``: a DeepSpeed config (``ds_config.json`` or a dict) read into this package's options.

Every key DeepSpeed documents is in :data:`lightning_zero.deepspeed_keys.KEYS` with what it becomes here; the migration page of the
documentation is that table. A key is one of three kinds:

* ``"map"``: it becomes a strategy option, a loss-scale setting, the precision the Trainer must use,
  a Trainer setting that is checked (batch sizes, accumulation, clipping), or the optimizer and
  LR scheduler built for a LightningModule without ``configure_optimizers``;
* ``"tune"``: it tunes DeepSpeed's own machinery (logging, buffers, kernels) and changes no number a
  run computes: one warning lists every such key present (none when it states what this package
  does anyway, e.g. ``"contiguous_gradients": true``);
* ``"refuse"``: it changes results and has no equivalent: one ``ValueError`` lists every such key
  with what to do instead (as does a key that is not in the table).

Keyword options given to the strategy override the config: an option whose value differs from its
default wins over the config's value for it; an option left at its default takes the config's.
DeepSpeed's ``"auto"`` (Hugging Face style) means "what the Trainer says" for the batch keys,
clipping and precision, and this package's own ``"auto"`` sizing for the bucket sizes.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_zero.config import LossScaleConfig, StrategyConfig
from lightning_zero.deepspeed_keys import KEYS, OO, OP, SAME_ANY, SECTIONS, Z
from lightning_zero.deepspeed_optim import check_optimizer_sections

#: ZeRO keys -> strategy options (value converted by _number / _bool)
_ZERO_OPTIONS = {
    "stage": "stage",
    "overlap_comm": "overlap_comm",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
}
_AUTO_KEEPS = {"reduce_bucket_size", "stage3_prefetch_bucket_size"}  # DeepSpeed "auto" -> our "auto"
_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
_AIO = {"block_size": "block_size", "queue_depth": "queue_depth"}
_AIO |= {"intra_op_parallelism": "threads", "thread_count": "threads"}


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in config.items():
        path = prefix + str(name)
        if path in SECTIONS and isinstance(value, Mapping):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _integer(path: str, value: Any) -> int:
    # JSON writes big sizes as 5e8: a float with an integral value is the integer it spells
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"{path}={value!r} must be a whole number")


def load(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config as a dict: ``config`` itself, or the JSON file at that path."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"config={config!r} must be a path to a DeepSpeed JSON file or a dict")
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"config={str(config)!r}: no such file; give the path to a DeepSpeed ds_config.json or a dict")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config={str(config)!r} is not valid JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"config={str(config)!r} holds a {type(loaded).__name__}; a DeepSpeed config is a JSON object")
    return loaded


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig:
    """A DeepSpeed config read into this package's terms (see the module docstring)."""

    raw: dict[str, Any]
    """The config as given (after reading the file)."""

    options: dict[str, Any] = field(default_factory=dict)
    """Strategy options (:func:`lightning_zero.options.strategy_config` keywords) the config sets."""

    loss_scale: LossScaleConfig | None = None
    """The fp16 dynamic loss scaling, when the config has an ``fp16`` section."""

    precision: str | None = None
    """The precision the Trainer (or Fabric) must use: "16-mixed", "bf16-mixed"; None: any."""

    not_precision: tuple[str, ...] = ()
    """Precisions the config turns off explicitly (``"enabled": false``)."""

    gradient_clipping: float | None = None
    """Clip the gradient norm to this (None: absent or "auto")."""

    micro_batch_size: int | None = None
    accumulation: int | None = None
    train_batch_size: int | None = None

    tuned: tuple[str, ...] = ()
    """Keys that only tune DeepSpeed's machinery (warned about once, at parse)."""

    @property
    def optimizer(self) -> dict[str, Any] | None:
        """The ``optimizer`` section (built by :func:`lightning_zero.deepspeed_optim.build`)."""
        return self.raw.get("optimizer")

    @property
    def scheduler(self) -> dict[str, Any] | None:
        """The ``scheduler`` section."""
        return self.raw.get("scheduler")


def parse(config: str | os.PathLike[str] | Mapping[str, Any]) -> DeepSpeedConfig:
    """Read a DeepSpeed config; ``ValueError`` listing every key without an equivalent, one warning
    listing the keys that only tune DeepSpeed's machinery."""
    raw = load(config)
    flat = _flatten(raw)
    refused: list[str] = []
    tuned: list[str] = []
    for path, value in flat.items():
        key = KEYS.get(path)
        if path in ("optimizer", "scheduler"):
            continue  # checked with their type below
        if key is None:
            refused.append(f"{path}: not a DeepSpeed key known here; remove it (or check its spelling)")
        elif key.kind == "refuse" and value != key.same:
            shown = "{...}" if isinstance(value, Mapping) else repr(value)
            refused.append(f"{path}={shown}: {key.becomes}")
        elif key.kind == "tune" and key.same is not SAME_ANY and value != key.same:
            tuned.append(f"{path}={value!r} ({key.becomes})")
    refused += check_optimizer_sections(raw)
    options, extra = _options(flat, refused, tuned)
    if refused:
        raise ValueError(
            "the DeepSpeed config has keys with no equivalent in lightning_zero:\n  "
            + "\n  ".join(refused)
            + "\nSee the DeepSpeed-config migration page for every key and what it becomes."
        )
    if tuned:
        warnings.warn(
            "lightning_zero: these DeepSpeed config keys only tune DeepSpeed's own machinery and change no result; "
            "they have no effect here:\n  " + "\n  ".join(tuned),
            UserWarning,
            stacklevel=3,
        )
    return DeepSpeedConfig(raw=raw, options=options, tuned=tuple(tuned), **extra)


def _device(path: str, value: Any, refused: list[str]) -> bool | str:
    tiers: dict[Any, bool | str] = {"cpu": "cpu", "nvme": "nvme", "none": False, None: False}
    if value not in tiers:
        refused.append(f'{path}={value!r}: use "cpu", "nvme" or "none"')
        return False
    return tiers[value]


def _options(flat: dict[str, Any], refused: list[str], tuned: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The strategy options and the other settings of a flattened config."""
    options: dict[str, Any] = {}
    extra: dict[str, Any] = {}

    def number(path: str, convert: Callable[[str, Any], Any] = _integer) -> Any:
        try:
            return convert(path, flat[path])
        except ValueError as exc:
            refused.append(str(exc))
            return None

    for key, option in _ZERO_OPTIONS.items():
        path = Z + key
        if path not in flat:
            continue
        value = flat[path]
        if value == "auto":
            if key in _AUTO_KEEPS:
                options[option] = "auto"
            continue  # the rest: this package's default
        if option == "overlap_comm":
            options[option] = bool(value)
        elif key == "stage" and value == 0:
            refused.append(f'{path}=0: stage 0 is plain data parallelism; use Trainer(strategy="ddp")')
        elif (converted := number(path)) is not None:
            options[option] = converted
    _offload(flat, options, refused)
    knobs = {name: number("aio." + key) for key, name in _AIO.items() if "aio." + key in flat}
    if knobs and "nvme_path" not in options:
        tuned.append(f"aio ({', '.join(sorted(knobs))}): no NVMe offload in this config, so no effect")
    elif knobs:
        options.setdefault("nvme_config", {}).update(knobs)
    for path, option in (("zero_allow_untested_optimizer", "allow_untested_optimizer"),):
        if path in flat:
            options[option] = bool(flat[path])
    if "checkpoint.use_node_local_storage" in flat:
        options["node_local_storage"] = bool(flat["checkpoint.use_node_local_storage"])
    if flat.get("activation_checkpointing.cpu_checkpointing"):
        options["activation_checkpointing_offload"] = True
    for path in ("communication_data_type", "data_types.grad_accum_dtype"):
        if path in flat and flat[path] is not None:
            if str(flat[path]) not in _DTYPES:
                refused.append(f"{path}={flat[path]!r}: use one of {sorted(_DTYPES)}")
            else:
                options["reduce_dtype"] = _DTYPES[str(flat[path])]
    for path in ("tensor_parallel.autotp_size", "tensor_parallel.tp_size", "tensor_parallel.tp.tp_size"):
        if path in flat and (size := number(path)) is not None:
            options["tensor_parallel_size"] = size
    _precision(flat, extra, refused)
    for path, name in (
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
        ("gradient_accumulation_steps", "accumulation"),
        ("train_batch_size", "train_batch_size"),
    ):
        if path in flat and flat[path] != "auto":
            extra[name] = number(path)
    if "gradient_clipping" in flat and flat["gradient_clipping"] != "auto":
        value = flat["gradient_clipping"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
            refused.append(f"gradient_clipping={value!r} must be a number >= 0 (0: no clipping)")
        elif value > 0:
            extra["gradient_clipping"] = float(value)
    return options, extra


def _offload(flat: dict[str, Any], options: dict[str, Any], refused: list[str]) -> None:
    if flat.get(Z + "cpu_offload"):
        options["offload_optimizer"] = "cpu"
    if flat.get(Z + "cpu_offload_params"):
        options["offload_parameters"] = "cpu"
    if Z + "cpu_offload_use_pin_memory" in flat:
        options["pin_memory"] = bool(flat[Z + "cpu_offload_use_pin_memory"])
    paths = set()
    knobs: dict[str, Any] = {}
    for prefix, option, buffers in (
        (OO, "offload_optimizer", "buffer_count"),
        (OP, "offload_parameters", "param_buffer_count"),
    ):
        if prefix + "device" not in flat:
            continue
        tier = _device(prefix + "device", flat[prefix + "device"], refused)
        options[option] = tier
        if prefix + "pin_memory" in flat:
            options["pin_memory"] = bool(flat[prefix + "pin_memory"])
        if tier != "nvme":
            continue  # DeepSpeed reads nvme_path and buffer_count only for the disk tier
        if flat.get(prefix + "nvme_path"):
            paths.add(str(flat[prefix + "nvme_path"]))
        if prefix + "buffer_count" in flat:
            try:
                knobs[buffers] = _integer(prefix + "buffer_count", flat[prefix + "buffer_count"])
            except ValueError as exc:
                refused.append(str(exc))
    if len(paths) > 1:
        refused.append(
            f"offload_optimizer.nvme_path and offload_param.nvme_path differ ({sorted(paths)}): lightning_zero keeps "
            "both tiers under one directory; give the same path to both"
        )
    elif paths:
        options["nvme_path"] = paths.pop()
    if knobs:
        options["nvme_config"] = knobs


def _precision(flat: dict[str, Any], extra: dict[str, Any], refused: list[str]) -> None:
    enabled = {name: flat.get(f"{name}.enabled") for name in ("fp16", "bf16")}
    on = [name for name, value in enabled.items() if value is True]
    if len(on) == 2:
        refused.append("fp16.enabled and bf16.enabled are both true: enable one")
    elif on:
        extra["precision"] = {"fp16": "16-mixed", "bf16": "bf16-mixed"}[on[0]]
    extra["not_precision"] = tuple(
        {"fp16": "16-mixed", "bf16": "bf16-mixed"}[name] for name, value in enabled.items() if value is False
    )
    if "fp16.loss_scale" in flat and flat["fp16.loss_scale"] not in (0, 0.0, "auto"):
        refused.append(
            f"fp16.loss_scale={flat['fp16.loss_scale']!r}: a fixed loss scale is not implemented; use 0 (dynamic)"
        )
    if not any(k.startswith("fp16.") for k in flat) or enabled["fp16"] is False:
        return
    scale: dict[str, Any] = {}
    for path, name in (
        ("fp16.initial_scale_power", "initial_scale"),
        ("fp16.loss_scale_window", "growth_interval"),
        ("fp16.min_loss_scale", "min_scale"),
    ):
        if path in flat and flat[path] != "auto":
            try:
                value = _integer(path, flat[path]) if name != "min_scale" else float(flat[path])
            except (TypeError, ValueError):
                refused.append(f"{path}={flat[path]!r} must be a number")
                continue
            scale[name] = 2.0**value if name == "initial_scale" else value
    # DeepSpeed's defaults where the config is silent: 2**16, window 1000, min 1 (ours are the same)
    try:
        extra["loss_scale"] = LossScaleConfig(**scale)
    except ValueError as exc:
        refused.append(f"fp16: {exc}")


# -- the strategies' side: explicit options override the config ---------------------------------------


def resolve(
    config: str | os.PathLike[str] | Mapping[str, Any] | None,
    given: Mapping[str, Any],
    build: Callable[..., StrategyConfig],
) -> tuple[DeepSpeedConfig | None, StrategyConfig | None, LossScaleConfig | None]:
    """The parsed DeepSpeed config, the ``StrategyConfig`` of the strategy's options merged over it,
    and the loss scaling; ``(None, None, given loss_scale)`` without a config.

    ``given`` holds the strategy's keyword arguments (its ``locals()``); ``build`` is
    :func:`lightning_zero.options.strategy_config`, whose parameters and defaults say which
    arguments are options and which values were left at their default.
    """
    loss_scale = given.get("loss_scale")
    if config is None:
        return None, None, loss_scale
    parsed = parse(config)
    merged: dict[str, Any] = {}
    extra: dict[str, Any] = {}  # build's **kwargs (torch DDP's other arguments): passed through as given
    for name, parameter in inspect.signature(build).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            extra = dict(given.get(name) or {})
            continue
        value = given.get(name, parameter.default)
        explicit = value is not parameter.default and value != parameter.default
        merged[name] = value if explicit or name not in parsed.options else parsed.options[name]
    if loss_scale is None:
        loss_scale = parsed.loss_scale
    try:
        built = build(**merged, **extra)
    except ValueError as exc:
        raise ValueError(f"with the DeepSpeed config's options {parsed.options}: {exc}") from exc
    return parsed, built, loss_scale


def check_precision(config: DeepSpeedConfig | None, precision: str) -> None:
    """``ValueError`` when the Trainer's (or Fabric's) precision is not the one the config enables."""
    if config is None:
        return
    if config.precision is not None and precision != config.precision:
        section = "fp16" if config.precision == "16-mixed" else "bf16"
        raise ValueError(
            f"the DeepSpeed config enables {section} ({section}.enabled=true) but the precision is {precision!r}: "
            f'use precision={config.precision!r} (Trainer or Fabric), or set {section}.enabled to "auto"'
        )
    if precision in config.not_precision:
        section = "fp16" if precision == "16-mixed" else "bf16"
        raise ValueError(
            f"the DeepSpeed config sets {section}.enabled=false but the precision is {precision!r}: remove the "
            f'{section} section (or set it to "auto"), or change the precision'
        )


# -- checks against the Trainer, and the optimizers it builds ------------------------------------------


def apply_to_trainer(config: DeepSpeedConfig | None, trainer: Any) -> None:
    """At setup: ``gradient_clipping`` becomes the Trainer's norm clipping when it has none (a
    different one is a ``ValueError``); ``gradient_accumulation_steps`` must be the Trainer's."""
    if config is None:
        return
    from lightning.pytorch.utilities import GradClipAlgorithmType

    if config.gradient_clipping is not None:
        if trainer.gradient_clip_val is None:
            trainer.gradient_clip_val = config.gradient_clipping
            trainer.gradient_clip_algorithm = GradClipAlgorithmType.NORM
        elif float(trainer.gradient_clip_val) != config.gradient_clipping or trainer.gradient_clip_algorithm not in (
            None,
            GradClipAlgorithmType.NORM,
        ):
            raise ValueError(
                f"the DeepSpeed config clips the gradient norm to gradient_clipping={config.gradient_clipping} but "
                f"the Trainer has gradient_clip_val={trainer.gradient_clip_val} "
                f"({trainer.gradient_clip_algorithm}): give one of the two, or the same value"
            )
    if config.accumulation is not None and config.accumulation != trainer.accumulate_grad_batches:
        raise ValueError(
            f"the DeepSpeed config has gradient_accumulation_steps={config.accumulation} but the Trainer has "
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: pass "
            f'Trainer(accumulate_grad_batches={config.accumulation}), or set the key to "auto"'
        )


def _loader_batch_size(trainer: Any) -> int | None:
    loaders = trainer.train_dataloader
    loaders = getattr(loaders, "iterables", loaders)  # a CombinedLoader wraps the user's loaders
    first = next(iter(loaders.values()), None) if isinstance(loaders, dict) else loaders
    first = first[0] if isinstance(first, (list, tuple)) and first else first
    size = getattr(first, "batch_size", None)
    if size is None:
        size = getattr(getattr(first, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else None


def check_batch(config: DeepSpeedConfig | None, trainer: Any, data_parallel_size: int) -> None:
    """At the start of training, when the train DataLoader exists: the config's batch keys must
    describe the run (``ValueError`` with the numbers otherwise; "auto" keys are not checked)."""
    if config is None or (config.micro_batch_size is None and config.train_batch_size is None):
        return
    micro = _loader_batch_size(trainer)
    if micro is None:
        warnings.warn(
            "lightning_zero: the train DataLoader has no batch_size, so the DeepSpeed config's "
            "train_micro_batch_size_per_gpu / train_batch_size could not be checked",
            UserWarning,
            stacklevel=2,
        )
        return
    if config.micro_batch_size is not None and micro != config.micro_batch_size:
        raise ValueError(
            f"the DeepSpeed config has train_micro_batch_size_per_gpu={config.micro_batch_size} but the train "
            f'DataLoader\'s batch_size is {micro}: make them equal, or set the key to "auto"'
        )
    if config.train_batch_size is not None:
        total = micro * trainer.accumulate_grad_batches * data_parallel_size
        if total != config.train_batch_size:
            raise ValueError(
                f"the DeepSpeed config has train_batch_size={config.train_batch_size} but the run trains "
                f"{micro} (batch_size) x {trainer.accumulate_grad_batches} (accumulate_grad_batches) x "
                f"{data_parallel_size} (data-parallel ranks) = {total} samples per step: make them agree, or set "
                'train_batch_size to "auto"'
            )


def install_optimizers(config: DeepSpeedConfig | None, module: Any) -> None:
    """When the config has ``optimizer`` / ``scheduler`` sections, give ``module`` a
    ``configure_optimizers`` (an instance attribute) that builds them (see
    :mod:`lightning_zero.deepspeed_optim`); ``ValueError`` when the module returns its own too."""
    if config is None or (config.optimizer is None and config.scheduler is None):
        return
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_zero.deepspeed_optim import build_optimizer, build_scheduler

    if getattr(module.configure_optimizers, "_from_deepspeed_config", False):
        return  # installed by an earlier fit with this config
    name = type(module).__name__
    own = is_overridden("configure_optimizers", module) and module.configure_optimizers
    if config.optimizer is not None and own:
        raise ValueError(
            f"{name} overrides configure_optimizers and the DeepSpeed config has an optimizer section: one of "
            "them would be ignored. Remove the section (and the scheduler's), or configure_optimizers"
        )
    if config.optimizer is None and not own:
        raise ValueError(f"the DeepSpeed config has a scheduler but no optimizer section, and {name} has no optimizer")

    def configure_optimizers() -> Any:
        if own:
            returned = own()
            if not isinstance(returned, torch.optim.Optimizer):
                raise ValueError(
                    f"{name}.configure_optimizers must return one optimizer (and no scheduler) for the DeepSpeed "
                    f"config's scheduler section; it returned {type(returned).__name__}: remove one of the two"
                )
            optimizer = returned
        else:
            optimizer = build_optimizer(config.optimizer or {}, [p for p in module.parameters() if p.requires_grad])
        if config.scheduler is None:
            return optimizer
        scheduler = build_scheduler(config.scheduler, optimizer, lambda: module.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    configure_optimizers._from_deepspeed_config = True  # type: ignore[attr-defined]
    module.configure_optimizers = configure_optimizers


def check_fabric(config: DeepSpeedConfig | None) -> None:
    """Fabric runs the user's loop: the keys that configure a loop are the user's to apply."""
    if config is None:
        return
    refused = []
    if config.optimizer is not None or config.scheduler is not None:
        refused.append(
            "optimizer / scheduler: Fabric takes the optimizer you create; build it with "
            "lightning_zero.deepspeed_optim.build_optimizer(section, model.parameters()) (and build_scheduler)"
        )
    if config.gradient_clipping is not None:
        refused.append(
            f"gradient_clipping={config.gradient_clipping}: call fabric.clip_gradients(model, optimizer, "
            f"max_norm={config.gradient_clipping}) before each step, and remove the key"
        )
    if refused:
        raise ValueError("the DeepSpeed config has keys Fabric's ZeroStrategy cannot apply:\n  " + "\n  ".join(refused))
    loop = [f"{k}={v}" for k, v in (("train_micro_batch_size_per_gpu", config.micro_batch_size),
            ("gradient_accumulation_steps", config.accumulation), ("train_batch_size", config.train_batch_size)) if v]  # fmt: skip
    if loop:
        warnings.warn(
            "lightning_zero: under Fabric your loop sets the batch: " + ", ".join(loop) + " are not checked (with "
            "accumulation, run that many micro-batches under fabric.no_backward_sync and divide the loss by it)",
            UserWarning,
            stacklevel=3,
        )
