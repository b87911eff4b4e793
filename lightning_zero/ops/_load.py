"""Finding the compiled ops, choosing a CPU path, and falling back to the reference loudly, once."""

from __future__ import annotations

import os
import warnings

import torch

ISA_ENV = "LIGHTNING_ZERO_CPU_ISA"
_CPU_CHOICES = ("auto", "avx512", "avx2", "scalar", "reference")

try:
    from lightning_zero import _C  # type: ignore[attr-defined]  # noqa: F401  (the built extension; loading it registers the ops)

    _LOAD_ERROR: str | None = None
except ImportError as exc:  # not built: no compiler at install time, or a source checkout
    _LOAD_ERROR = str(exc)

_warned = False  # the "not compiled" warning was given
_warned_no_cuda = False  # the "compiled without CUDA kernels" warning was given (a different one)


def compiled() -> bool:
    """True when ``lightning_zero._C`` loaded and ``torch.ops.lightning_zero`` holds the kernels."""
    return _LOAD_ERROR is None


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"lightning_zero.ops: the compiled extension is not available ({_LOAD_ERROR}); using the "
            "PyTorch reference implementations, which are correct but make several passes over "
            "memory. Reinstall with `pip install --no-build-isolation -e .` on a machine with a C++ "
            "compiler to build it.",
            RuntimeWarning,
            stacklevel=3,
        )


def supported_isas() -> list[str]:
    """Compiled CPU paths this machine can run, best first (empty when not compiled)."""
    return list(torch.ops.lightning_zero.cpu_supported_isas()) if compiled() else []


def cpu_path() -> str:
    """The CPU path the next op call takes: an ISA name, or ``"reference"``.

    Read from ``LIGHTNING_ZERO_CPU_ISA`` on every call (a dictionary lookup) so tests can switch
    paths with monkeypatch.setenv; "auto" (the default) is the best path the CPU supports.
    """
    choice = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if choice not in _CPU_CHOICES:
        raise ValueError(f"{ISA_ENV}={choice!r} is not one of {', '.join(_CPU_CHOICES)}")
    if choice == "reference":
        return choice
    if not compiled():
        if choice != "auto":
            raise ValueError(
                f"{ISA_ENV}={choice} asks for a compiled kernel but lightning_zero._C is "
                f"not built ({_LOAD_ERROR}); rebuild it or set {ISA_ENV}=reference"
            )
        _warn_fallback()
        return "reference"
    isas = supported_isas()
    if choice == "auto":
        return isas[0]
    if choice not in isas:
        raise ValueError(f"{ISA_ENV}={choice} is not supported by this CPU; it supports {isas}")
    return choice


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return compiled() and torch._C._dispatch_has_kernel_for_dispatch_key("lightning_zero::fused_adam_step", "CUDA")


def fused_path(device: torch.device) -> str:
    """ "cuda" or "cpu" (compiled kernels for that device) or "reference"."""
    if device.type == "cuda" and has_cuda_kernels():
        return "cuda"
    if device.type == "cpu" and compiled() and cpu_path() != "reference":
        return "cpu"
    if compiled() and device.type == "cuda":
        global _warned_no_cuda
        if not _warned_no_cuda:
            _warned_no_cuda = True
            warnings.warn(
                "lightning_zero.ops: built without CUDA kernels; FusedAdam/FusedLamb use "
                "the PyTorch reference on the GPU. Rebuild where nvcc and a CUDA torch "
                "exist.",
                RuntimeWarning,
                stacklevel=3,
            )
    elif not compiled():
        _warn_fallback()
    return "reference"


def available() -> dict[str, str]:
    """Op name -> implementation in use, e.g. ``{"cpu_adam": "avx512", "fused_adam": "unavailable"}``.

    CPU ops: the ISA (``LIGHTNING_ZERO_CPU_ISA`` honoured) or "reference". Fused ops: "cuda" when
    the CUDA kernels are built, "reference" when a GPU exists but they are not, "unavailable"
    without a GPU (FusedAdam/FusedLamb still run on CPU tensors, through the CPU kernels).
    """
    cpu = cpu_path()
    fused = "cuda" if has_cuda_kernels() else "reference" if torch.cuda.is_available() else "unavailable"
    return {"cpu_adam": cpu, "cpu_lamb": cpu, "fused_adam": fused, "fused_lamb": fused}
