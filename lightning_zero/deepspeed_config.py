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

Reading the config into options is :mod:`lightning_zero.deepspeed_parse`; this module is what the
strategies call: the options merged (:func:`resolve`), then the checks and settings against the
Trainer or Fabric, and the optimizers built for a LightningModule without ``configure_optimizers``.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_zero.config import LossScaleConfig, StrategyConfig
from lightning_zero.deepspeed_parse import DeepSpeedConfig, parse

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
