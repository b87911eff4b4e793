"""What the hardware computes fast: native bf16 or not, and the precision to train in by default.

bf16 is fast only where the hardware multiplies bf16 natively: on x86 CPUs the AVX512_BF16 or AMX
instructions, on NVIDIA GPUs Ampere and newer. Without them torch converts bf16 to fp32 and back
around every matmul: on an AVX2-only AMD EPYC a 1024 x 1024 bf16 matmul runs ~40x slower than in
fp32 (torch 2.13, one thread), so "bf16-mixed" there is a slowdown, not a speed-up.

- :func:`native_bf16` says whether a device has native bf16: on Linux CPUs from the cpuid flags in
  ``/proc/cpuinfo`` (``avx512_bf16`` or ``amx_bf16``), elsewhere from
  ``torch.backends.cpu.get_cpu_capability()`` ("AVX512" means an AVX-512 build path, which on CPUs
  with AVX512_BF16 runs bf16 natively; we accept it there since no flag list is available); on CUDA
  from ``torch.cuda.is_bf16_supported()``.
- :func:`auto_precision` is the precision the recipes' ``precision: auto`` resolves to: "bf16-mixed"
  with native bf16, else "32-true".
- :func:`warn_if_slow_bf16` is called by :class:`~lightning_zero.OffloadPrecision` when it is set
  up: a run asking for a bf16 precision on a CPU without native bf16 gets one warning (once per
  process, on rank 0) with the measured bf16/fp32 matmul time ratio of a tiny probe, and goes on.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

#: the cpuid flags (as /proc/cpuinfo spells them) of native bf16 arithmetic on x86 CPUs
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

#: the precision strings that compute in bf16
_BF16_PRECISIONS = ("bf16-mixed", "bf16-true")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags from the first ``flags`` line of ``cpuinfo``; None where it cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def native_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bf16 natively (see the module docstring for how it is decided)."""
    device = torch.device(device)
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    flags = cpu_flags() if sys.platform.startswith("linux") else None
    if flags is not None:
        return any(flag in flags for flag in BF16_CPU_FLAGS)
    # No flag list (macOS, Windows): torch's dispatch level is the best available signal.
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def auto_precision(device: torch.device | str) -> str:
    """The fastest precision of ``device``: "bf16-mixed" where it has native bf16, else "32-true"."""
    return "bf16-mixed" if native_bf16(device) else "32-true"


def resolve_precision(precision: str | int | None, device: torch.device | str) -> str | int | None:
    """``precision`` itself, or :func:`auto_precision` of ``device`` when it is "auto"."""
    return auto_precision(device) if precision == "auto" else precision


def matmul_ratio(size: int = 256, repeats: int = 3) -> float:
    """Time of a ``size`` x ``size`` bf16 matmul over the same in fp32 on this CPU (best of ``repeats``).

    About 0.1 s on an AVX2-only CPU (where the ratio is ~40) with the defaults; less elsewhere.
    """
    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)  # warm-up: first-call allocation and dispatch
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(a, b)
    bf16 = best(a.bfloat16(), b.bfloat16())
    return bf16 / max(fp32, 1e-9)


def warn_if_slow_bf16(precision: str, device: torch.device | str) -> None:
    """One warning per process (rank 0) when ``precision`` computes in bf16 on a CPU without native bf16."""
    if precision not in _BF16_PRECISIONS or torch.device(device).type != "cpu" or native_bf16("cpu"):
        return
    # the probe runs only where the warning is shown; getattr: Lightning sets `rank` on the function object
    if getattr(rank_zero_only, "rank", 0) == 0:
        _warn_slow_bf16(precision)


@functools.cache
def _warn_slow_bf16(precision: str) -> None:
    ratio = matmul_ratio()
    rank_zero_warn(
        f"precision={precision!r} on a CPU without native bf16 (no {' / '.join(BF16_CPU_FLAGS)}): a bf16 matmul "
        f"measured {ratio:.1f}x the time of the same in fp32 here. The run goes on; precision='32-true' "
        "(or 'auto' in the recipes) is faster on this machine."
    )
