"""Finding the compiled ops, choosing a CPU path, and falling back to the reference loudly, once.

The ops come from ``lightning_zero._C`` when it was built at install (``pip install
--no-build-isolation -e .``, or ``LIGHTNING_ZERO_BUILD_OPS=1``), else they are compiled on first
use into a per-torch-version cache (:mod:`lightning_zero.ops._build`). Nothing is loaded at import:
the first :func:`compiled` call decides.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

ISA_ENV = "LIGHTNING_ZERO_CPU_ISA"
_CPU_CHOICES = ("auto", "avx512", "avx2", "scalar", "reference")

_NOT_TRIED = "the compiled ops were not loaded yet"
_LOAD_ERROR: str | None = _NOT_TRIED  # None once loaded; else why not (tests set it to simulate a missing build)
_loading = threading.Lock()

_warned = False  # the "not compiled" warning was given
_warned_no_cuda = False  # the "compiled without CUDA kernels" warning was given (a different one)


def _try_load() -> str | None:
    try:
        from lightning_zero import _C  # type: ignore[attr-defined]  # noqa: F401  (the built extension; loading it registers the ops)

        return None
    except ImportError as exc:  # not built at install: compile on first use
        prebuilt = str(exc)
    from lightning_zero.ops import _build

    reason = _build.load()
    return None if reason is None else f"{reason}; no prebuilt library either ({prebuilt})"


def compiled() -> bool:
    """True when the ops are loaded into ``torch.ops.lightning_zero`` (prebuilt, cached, or compiled now)."""
    global _LOAD_ERROR
    if _LOAD_ERROR is _NOT_TRIED:
        with _loading:
            if _LOAD_ERROR is _NOT_TRIED:
                error = _try_load()
                if error is None:
                    from lightning_zero.ops import _fake

                    _fake.register()
                _LOAD_ERROR = error
    return _LOAD_ERROR is None


def _warn_fallback() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"lightning_zero.ops: the compiled extension is not available ({_LOAD_ERROR}); using the "
            "PyTorch reference implementations, which are correct but make several passes over "
            "memory. Install a C++ compiler (g++) and ninja and they are compiled on first use, or build them "
            "at install with `LIGHTNING_ZERO_BUILD_OPS=1 pip install --no-build-isolation .`.",
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
                f"{ISA_ENV}={choice} asks for a compiled kernel but the ops are "
                f"not built ({_LOAD_ERROR}); install a compiler and ninja, or set {ISA_ENV}=reference"
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
