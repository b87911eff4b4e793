"""The precisions ZeRO runs under (:data:`PRECISIONS`, Lightning's spellings of them) and dynamic loss
scaling for "16-mixed" (:class:`LossScaleConfig`), validated where they are built. Also importable from
:mod:`lightning_zero.config`; the plugin that uses them is :class:`lightning_zero.OffloadPrecision`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
