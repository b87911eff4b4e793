"""The ``optimizer`` and ``scheduler`` sections of a DeepSpeed config, built as torch objects.

DeepSpeed builds them when the client passes no optimizer; here they are built for a LightningModule
that does not override ``configure_optimizers`` (a module that does, together with a config that has
an ``optimizer`` section, is a ``ValueError``: one of the two would be ignored). DeepSpeed's
``"Adam"`` is AdamW unless ``adam_w_mode`` is false (its FusedAdam default), so it becomes
``torch.optim.AdamW``; its weight decay defaults to 0 (torch's AdamW: 0.01), which is passed
explicitly. The schedules are DeepSpeed's formulas (``deepspeed/runtime/lr_schedules.py``) as a
torch ``LRScheduler`` stepped after every optimizer step: the k-th step uses the learning rate
DeepSpeed's scheduler gives at its iteration k - 1 (the value set at construction for k = 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler


@dataclass(frozen=True)
class Key:
    """One DeepSpeed config key: its kind ("map", "tune", "refuse") and what it becomes here."""

    kind: str
    becomes: str
    same: Any = None  # tune and refuse keys: the value that states this package's own behaviour (no message)


_AUTO_TIP = "no Trainer setting supplies it; give a number (or return your optimizer from configure_optimizers)"

# type (lower case) -> (builder name, its parameters with DeepSpeed's defaults)
_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
             "adam_w_mode": True, "amsgrad": False, "torch_adam": False, "fused": None},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
              "adam_w_mode": True, "amsgrad": False, "torch_adam": False, "fused": None},
    "lamb": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True},
    "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
}  # fmt: skip
_REFUSED_OPTIMIZERS = {
    "onebitadam": '1-bit Adam compresses the gradient communication (results change): use "Adam"',
    "zerooneadam": '0/1 Adam compresses the gradient communication (results change): use "Adam"',
    "onebitlamb": '1-bit LAMB compresses the gradient communication (results change): use "Lamb"',
}
_LAMB_REFUSED = ("max_coeff", "min_coeff", "max_grad_norm")

_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"}
_SCHEDULERS: dict[str, dict[str, Any]] = {
    "warmuplr": dict(_WARMUP),
    "warmupdecaylr": {**_WARMUP, "warmup_max_lr": 0.001, "total_num_steps": None},
    "warmupcosinelr": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "onecycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0},
}  # fmt: skip
_SCHEDULE_NAMES = {"warmuplr": "WarmupLR", "warmupdecaylr": "WarmupDecayLR", "warmupcosinelr": "WarmupCosineLR"}
_SCHEDULE_NAMES["onecycle"] = "OneCycle"

#: The optimizer and scheduler keys of the migration table (see :data:`lightning_zero.deepspeed_keys.KEYS`).
OPTIMIZER_KEYS: dict[str, Key] = {
            "optimizer.type=Adam": Key("map", "torch.optim.AdamW (torch.optim.Adam with adam_w_mode=false); "
                                       "bias_correction=false: lightning_zero.ops.FusedAdam"),
            "optimizer.type=AdamW": Key("map", "torch.optim.AdamW (bias_correction=false: lightning_zero.ops.FusedAdam)"),
            "optimizer.type=Lamb": Key("map", "lightning_zero.ops.FusedLamb (trust ratio not clamped: max_coeff, "
                                       "min_coeff and max_grad_norm are refused)"),
            "optimizer.type=Lion": Key("map", "lightning_zero.ops.Lion"),
            "optimizer.type=Adagrad": Key("map", "torch.optim.Adagrad"),
            "optimizer.type=OneBitAdam / ZeroOneAdam / OneBitLamb": Key("refuse", "compressed communication: use Adam / Lamb"),
            "optimizer.params (lr, betas, eps, weight_decay, bias_correction, adam_w_mode, amsgrad)": Key(
                "map", "the optimizer's arguments, DeepSpeed's defaults where absent (\"auto\" is refused)"),
            "optimizer.params.torch_adam / fused": Key("tune", "which Adam kernel DeepSpeed runs"),
}  # fmt: skip
SCHEDULER_KEYS: dict[str, Key] = {
            "scheduler.type=WarmupLR": Key("map", "DeepSpeed's WarmupLR formula as a torch LRScheduler (every step)"),
            "scheduler.type=WarmupDecayLR": Key("map", "DeepSpeed's WarmupDecayLR formula (total_num_steps \"auto\": "
                                                "trainer.estimated_stepping_batches)"),
            "scheduler.type=WarmupCosineLR": Key("map", "DeepSpeed's WarmupCosineLR formula (as above)"),
            "scheduler.type=OneCycle": Key("map", "DeepSpeed's OneCycle formula, momentum (beta1) cycled too"),
            "scheduler.type=LRRangeTest": Key("refuse", "use Lightning's Tuner.lr_find"),
            "scheduler.params.warmup_min_lr / warmup_max_lr": Key("map", "\"auto\": 0 / the optimizer's lr"),
            "scheduler.params.warmup_num_steps": Key("map", "as given (\"auto\" is refused: give a number)"),
}  # fmt: skip


def _lower(section: Any) -> str:
    return str(section.get("type", "")).lower() if isinstance(section, dict) else ""


def check_optimizer_sections(raw: dict[str, Any]) -> list[str]:
    """What is wrong with the ``optimizer`` / ``scheduler`` sections, one line per key (empty: fine)."""
    problems: list[str] = []
    for section, known in (("optimizer", _OPTIMIZERS), ("scheduler", _SCHEDULERS)):
        if section not in raw:
            continue
        value = raw[section]
        kind = _lower(value)
        if not isinstance(value, dict) or set(value) - {"type", "params"}:
            problems.append(f'{section}: must be {{"type": ..., "params": {{...}}}}')
            continue
        if kind in _REFUSED_OPTIMIZERS:
            problems.append(f"{section}.type={value['type']!r}: {_REFUSED_OPTIMIZERS[kind]}")
            continue
        if kind not in known:
            names = (
                "Adam, AdamW, Lamb, Lion, Adagrad" if section == "optimizer" else ", ".join(_SCHEDULE_NAMES.values())
            )
            problems.append(f"{section}.type={value.get('type')!r}: use one of {names}, or configure_optimizers")
            continue
        params = value.get("params") or {}
        for name in sorted(set(params) - set(known[kind])):
            why = (
                "DeepSpeed's Lamb clamps the trust ratio; lightning_zero's does not"
                if name in _LAMB_REFUSED
                else "unknown"
            )
            problems.append(f"{section}.params.{name}: {why}; remove it")
        for name, param in params.items():
            auto_ok = section == "scheduler" and name in ("warmup_min_lr", "warmup_max_lr", "total_num_steps")
            if param == "auto" and not auto_ok and not (section == "optimizer" and name in ("torch_adam", "fused")):
                problems.append(f'{section}.params.{name}="auto": {_AUTO_TIP}')
    return problems


def build_optimizer(section: dict[str, Any], params: Iterable[Any]) -> torch.optim.Optimizer:
    """The torch optimizer of a DeepSpeed ``optimizer`` section over ``params`` (checked by
    :func:`check_optimizer_sections`)."""
    from lightning_zero import ops

    kind = _lower(section)
    args = {**_OPTIMIZERS[kind], **(section.get("params") or {})}
    for name in ("torch_adam", "fused"):
        args.pop(name, None)
    if "betas" in args:
        args["betas"] = tuple(args["betas"])
    if kind in ("adam", "adamw"):
        adamw = bool(args.pop("adam_w_mode")) or kind == "adamw"
        if not args.pop("bias_correction"):
            if args.pop("amsgrad"):
                raise ValueError("optimizer: amsgrad with bias_correction=false has no implementation; drop one")
            return ops.FusedAdam(params, adamw_mode=adamw, bias_correction=False, **args)
        return (torch.optim.AdamW if adamw else torch.optim.Adam)(params, **args)
    if kind == "lamb":
        return ops.FusedLamb(params, **args)
    if kind == "lion":
        return ops.Lion(params, **args)
    return torch.optim.Adagrad(params, **args)


class DeepSpeedSchedule(LRScheduler):
    """One of DeepSpeed's schedules (``kind``: "warmuplr", "warmupdecaylr", "warmupcosinelr",
    "onecycle") with its ``params``, stepped after every optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: dict[str, Any]) -> None:
        self.kind = kind
        self.params = {**_SCHEDULERS[kind], **params}
        if self.params.get("warmup_type", "log") not in ("log", "linear"):
            raise ValueError(f'scheduler warmup_type={self.params["warmup_type"]!r}: use "log" or "linear"')
        if kind == "onecycle" and (self.params["cycle_min_lr"] is None or self.params["cycle_max_lr"] is None):
            raise ValueError("scheduler OneCycle needs cycle_min_lr and cycle_max_lr")
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]  # torch's stub returns list[float | Tensor]
        it = self.last_epoch - 1  # DeepSpeed's last_batch_iteration for this step (see the module docstring)
        lrs = [self._lr(it, float(base)) for base in self.base_lrs]
        if self.kind == "onecycle" and self.params["cycle_momentum"]:
            for group in self.optimizer.param_groups:
                if "betas" in group:
                    group["betas"] = (self._momentum(it), 0.99)  # DeepSpeed replaces beta2 by 0.99
        return lrs

    def _gamma(self, it: int, steps: int) -> float:
        if self.params["warmup_type"] == "log":
            return math.log(it + 1) / math.log(steps)
        return it / steps

    def _lr(self, it: int, base: float) -> float:
        p = self.params
        if self.kind == "onecycle":
            return self._one_cycle(it)
        steps = max(2, int(p["warmup_num_steps"]))
        if self.kind == "warmupcosinelr":
            if it < 0:
                return 0.0
            if it < steps:
                return base * (p["warmup_min_ratio"] + self._gamma(it, steps) * (1.0 - p["warmup_min_ratio"]))
            progress = min(1.0, (it - steps + 1) / max(1, p["total_num_steps"] - steps))
            ratio = (1 + math.cos(math.pi * progress)) / 2
            return base * max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * ratio)
        low = p["warmup_min_lr"]
        high = base if p["warmup_max_lr"] is None else p["warmup_max_lr"]
        if it < 0:
            return low
        if it < steps:
            gamma = self._gamma(it, steps)
        elif self.kind == "warmupdecaylr":
            gamma = max(0.0, float(p["total_num_steps"] - it) / float(max(1.0, p["total_num_steps"] - steps)))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    def _scale(self, it: int) -> float:
        p = self.params
        first = float(p["cycle_first_step_size"])
        second = float(p["cycle_second_step_size"]) if p["cycle_second_step_size"] is not None else first
        total = first + second
        batch = it + 1
        x = 1.0 + batch / total - math.floor(1 + batch / total)
        stairs = p["cycle_first_stair_count"] if x <= first / total else p["cycle_second_stair_count"]
        if stairs is None:
            stairs = p["cycle_first_stair_count"]
        scale = x / (first / total) if x <= first / total else (x - 1) / (first / total - 1)
        if stairs > 0:
            position = batch % total
            position = position * stairs / first if position <= first else (total - position) * stairs / second
            scale = math.floor(position) / stairs
        return scale

    def _total(self) -> float:
        p = self.params
        second = p["cycle_second_step_size"] if p["cycle_second_step_size"] is not None else p["cycle_first_step_size"]
        return float(p["cycle_first_step_size"]) + float(second)

    def _one_cycle(self, it: int) -> float:
        p = self.params
        if it < 0:
            return p["cycle_min_lr"]
        if it < self._total():
            return p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * self._scale(it)
        if p["decay_step_size"] == 0 or p["decay_lr_rate"] == 0:
            return p["cycle_min_lr"]
        interval = (it - self._total() + 1) / p["decay_step_size"]
        return p["cycle_min_lr"] / (1 + p["decay_lr_rate"] * interval)

    def _momentum(self, it: int) -> float:
        p = self.params
        if it < 0:
            return p["cycle_min_mom"]
        if it < self._total():
            return p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * self._scale(it)
        if p["decay_step_size"] == 0 or p["decay_mom_rate"] == 0:
            return p["cycle_max_mom"]
        interval = (it - self._total() + 1) / p["decay_step_size"]
        return p["cycle_max_mom"] * (1 + p["decay_mom_rate"] * interval)


def build_scheduler(
    section: dict[str, Any], optimizer: torch.optim.Optimizer, total_steps: Callable[[], int]
) -> DeepSpeedSchedule:
    """The schedule of a DeepSpeed ``scheduler`` section; ``"auto"`` values: ``warmup_min_lr`` 0,
    ``warmup_max_lr`` the optimizer's lr, ``total_num_steps`` ``total_steps()`` (the Trainer's
    ``estimated_stepping_batches``)."""
    kind = _lower(section)
    params = dict(section.get("params") or {})
    if params.get("warmup_min_lr") == "auto":
        params["warmup_min_lr"] = 0.0
    if params.get("warmup_max_lr") == "auto":
        params["warmup_max_lr"] = None  # the optimizer's lr
    if kind in ("warmupdecaylr", "warmupcosinelr") and params.get("total_num_steps") in (None, "auto"):
        params["total_num_steps"] = int(total_steps())
    return DeepSpeedSchedule(optimizer, kind, params)
