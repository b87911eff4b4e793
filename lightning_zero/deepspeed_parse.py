"""A DeepSpeed config read into this package's terms: :func:`parse` gives the
:class:`DeepSpeedConfig` that :mod:`lightning_zero.deepspeed_config` (whose docstring says what a
key of each kind becomes) applies to the strategies, the Trainer and Fabric.

The config is flattened along :data:`~lightning_zero.deepspeed_keys.SECTIONS` into dotted paths,
each looked up in :data:`~lightning_zero.deepspeed_keys.KEYS`; the ``"map"`` keys become strategy
options (the ZeRO, offload, aio, precision and batch keys below), the others one warning or one
``ValueError`` listing them all.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_zero.config import LossScaleConfig
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
    """A DeepSpeed config read into this package's terms (see :mod:`lightning_zero.deepspeed_config`)."""

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
