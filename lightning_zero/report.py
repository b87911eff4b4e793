"""Per-rank memory of model states for a parameter count and a layout, from the ZeRO formulas.

The yardstick of docs/stages.md (ZeRO paper, arXiv 1910.02054 section 5): per parameter, mixed-precision
Adam keeps 2 bytes of 16-bit parameters, 2 of 16-bit gradients and 12 of fp32 master + two moments;
"32-true" keeps 4 + 4 + 8. Stage 1 shards the master and moments over the N data-parallel ranks,
stage 2 also the gradients, stage 3 also the parameters; ``offload_optimizer`` moves master and
moments (and the fp32 gradient copy the step reads) to host memory, ``offload_parameters`` the
parameter shards too. Activations, buckets and fragmentation come on top and are not estimated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lightning_zero.config import normalize_precision

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"124M"`` -> 124_000_000; ``"1.5B"``, ``"350m"``, ``"7e9"``, ``"1000"`` work too."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    if not match:
        raise ValueError(f"parameter count {text!r} is not a number such as 124M, 1.5B or 350000000")
    value = float(match.group(1)) * _SUFFIX[match.group(2)]
    if value <= 0:
        raise ValueError(f"parameter count {text!r} must be positive")
    return int(value)


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank, by category and where they live."""

    params: int
    data_parallel: int
    stage: int
    precision: str
    device: dict[str, float]
    host: dict[str, float]

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())


def estimate(
    params: int,
    data_parallel: int,
    stage: int,
    precision: str = "bf16-mixed",
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
) -> Estimate:
    """Model-state bytes per rank for ``params`` parameters on ``data_parallel`` ranks."""
    precision = normalize_precision(precision)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} must be 0 (DDP), 1, 2 or 3")
    if data_parallel < 1:
        raise ValueError(f"data_parallel={data_parallel} must be >= 1")
    if offload_parameters and (stage != 3 or not offload_optimizer):
        raise ValueError("offload_parameters needs stage 3 and offload_optimizer (as ZeroStrategy does)")
    n = data_parallel
    half = precision in ("bf16-mixed", "16-mixed", "bf16-true")
    p_bytes = 2 if half else 4
    master = 4 if precision in ("bf16-mixed", "16-mixed") else 0  # separate fp32 copy
    moments = 4 if precision == "bf16-true" else 8
    shard = {"parameters": stage >= 3, "gradients": stage >= 2, "optimizer": stage >= 1}
    device = {
        "parameters": params * p_bytes / (n if shard["parameters"] else 1),
        "gradients": params * p_bytes / (n if shard["gradients"] else 1),
        "master_weights": params * master / (n if shard["optimizer"] else 1),
        "optimizer_states": params * moments / (n if shard["optimizer"] else 1),
    }
    host = dict.fromkeys(device, 0.0)
    if offload_optimizer:
        for key in ("master_weights", "optimizer_states"):
            host[key], device[key] = device[key], 0.0
        if not master:  # fp32 runs keep a separate host master when offloaded
            host["master_weights"] = params * 4 / n
        host["gradients"] = params * 4 / n  # the fp32 slice the CPU step reads
    if offload_parameters:
        host["parameters"], device["parameters"] = device["parameters"], 0.0
    return Estimate(params, n, stage, precision, device, host)


def format_estimate(e: Estimate) -> str:
    """A small table in GiB."""
    gib = 2.0**30
    rows = [
        f"{e.params:,} parameters, {e.data_parallel} data-parallel ranks, stage {e.stage}, {e.precision}",
        f"{'':18}{'device GiB':>12}{'host GiB':>12}",
    ]
    for key in e.device:
        rows.append(f"{key:18}{e.device[key] / gib:12.3f}{e.host[key] / gib:12.3f}")
    rows.append(f"{'total':18}{e.device_total / gib:12.3f}{e.host_total / gib:12.3f}")
    rows.append("(model states only: activations, communication buckets and fragmentation come on top)")
    return "\n".join(rows)
