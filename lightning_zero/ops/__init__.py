"""Compiled optimizers for the step of the ZeRO data path (see docs/architecture.md, "step").

What is here
    ``CPUAdam``, ``CPULamb``: torch.optim.Optimizer classes for fp32 parameters on the CPU (the
    offload path). One pass per step reads grad, param, exp_avg, exp_avg_sq and writes param and
    the states, optionally multiplying the gradient by an unscale/clip coefficient, writing a
    bf16/fp16 copy of the updated parameter, and keeping the states in bf16.
    ``FusedAdam``, ``FusedLamb``: multi-tensor CUDA kernels (many tensors per launch, fp32 master
    with 16-bit copies, optional on-device unscale).
    ``Lion``: the Lion optimizer (torch has none); fp32 CPU parameters step with the compiled
    single-pass kernel. Adagrad needs no class: torch.optim.Adagrad is mapped to the compiled
    ``functional.cpu_adagrad_step`` by the offloaded ZeRO step.
    ``functional``: the same as plain functions on flat buffers, including the two-phase LAMB that
    works on ZeRO shards whose boundaries cut through parameters (norm pieces summed across ranks).
    ``available()``: op name -> implementation in use, e.g. {"cpu_adam": "avx512", ...}.
    ``checksum.crc32``: zlib's CRC-32 of checkpoint bytes, PCLMULQDQ-folded (``zlib.crc32`` is the reference).

How it is built
    ``pip install --no-build-isolation -e .`` runs setup.py, which compiles csrc/ into
    ``lightning_zero._C`` (C++ always; CUDA when torch is a CUDA build and nvcc exists). The ops
    live in ``torch.ops.lightning_zero`` (TORCH_LIBRARY: schemas, CPU and CUDA kernels; fake
    kernels in _fake.py). The AVX-512, AVX2 and scalar CPU paths are all compiled; the best one the
    CPU supports (cpuid + XGETBV) is taken at run time.

Forcing a path
    ``LIGHTNING_ZERO_CPU_ISA=auto|avx512|avx2|scalar|reference`` (read at every call). Asking for
    a path the CPU or the build lacks raises ValueError.

Fallback
    Without the compiled library every op runs the readable PyTorch implementation in
    ``reference.py`` (the same numbers, several passes over memory) after a one-time
    RuntimeWarning saying how to build it.
"""

from lightning_zero.ops import functional
from lightning_zero.ops._load import ISA_ENV, available, compiled
from lightning_zero.ops.lion import Lion
from lightning_zero.ops.optimizers import CPUAdam, CPULamb, FusedAdam, FusedLamb

__all__ = ["CPUAdam", "CPULamb", "FusedAdam", "FusedLamb", "ISA_ENV", "Lion", "available", "compiled", "functional"]
