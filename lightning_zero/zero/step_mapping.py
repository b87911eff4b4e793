"""The user's optimizer mapped onto the compiled kernels of :mod:`lightning_zero.ops`: which kernel
steps its master slices (:class:`~lightning_zero.zero.step_kernels.KernelStep`), or none, when its
own ``step()`` is right; and the kernel's hyperparameters, read from each parameter group at every
step, so that LR schedulers keep working.

* LAMB (``ops.CPULamb``/``ops.FusedLamb``): always the shard-aware kernels
  (:mod:`~lightning_zero.zero.step_lamb`), offloaded or not.
* Offloaded masters: exactly torch's Adam/AdamW (or ``ops.CPUAdam``/``ops.FusedAdam``), Adagrad or
  ``ops.Lion`` runs the compiled kernel with the same hyperparameters; a subclass (which may add to
  ``step()``), a class whose ``step`` was patched, or an option the kernels lack (amsgrad, maximize,
  differentiable) runs its own ``step()`` on the host masters, as DeepSpeed does with
  ``zero_force_ds_cpu_optimizer=False``.
* Masters in host memory without offload (CPU training): torch's Adam/AdamW also runs the compiled
  kernel when it is compiled (one pass instead of torch's several).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal

import torch

from lightning_zero.zero.flat import FlatBuffer

#: moment dtypes the CPU kernels store (``state_dtype`` of lightning_zero's optimizers)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)

#: the classes whose own ``step`` the kernels replace
_KERNEL_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def adam_family() -> tuple[type, ...]:
    """The classes the compiled Adam kernel steps (exactly these, not subclasses)."""
    from lightning_zero import ops

    return (torch.optim.Adam, torch.optim.AdamW, ops.CPUAdam, ops.FusedAdam)


def lamb_family() -> tuple[type, ...]:
    """The LAMB classes of :mod:`lightning_zero.ops` (and their subclasses): the shard-aware kernels."""
    from lightning_zero import ops

    return (ops.CPULamb, ops.FusedLamb)


def one_state_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """ "adagrad" for exactly torch.optim.Adagrad, "lion" for exactly ops.Lion, else None."""
    from lightning_zero import ops

    return {torch.optim.Adagrad: "adagrad", ops.Lion: "lion"}.get(type(optimizer))


def step_replaced(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the class's ``step`` is no longer torch's (patched or wrapped on the class, e.g. by
    instrumentation or ``mock.patch("torch.optim.Adam.step")``): then that ``step`` runs, as under
    DDP, instead of a kernel that would bypass it. Decided by what the step is now (torch's function
    of that class, under torch's own wrappers), not against a copy taken at import: a patch made
    before this package was imported would be that copy."""
    cls = type(optimizer)
    if cls not in _KERNEL_CLASSES:
        return False
    step = inspect.unwrap(cls.step)
    torch_steps = {(k.__module__, f"{k.__name__}.step") for k in cls.__mro__ if k.__module__.startswith("torch.optim")}
    return not (inspect.isfunction(step) and (step.__module__, step.__qualname__) in torch_steps)


def kernel_hyper(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """Kernel hyperparameters of one parameter group (read live: schedulers change ``lr``)."""
    beta1, beta2 = group["betas"]
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError(
            f"{type(optimizer).__name__}(amsgrad={group.get('amsgrad')}, maximize={group.get('maximize')}) has no "
            "offloaded CPU kernel; use amsgrad=False and maximize=False, or offload_optimizer=False."
        )
    adamw = group.get(
        "adamw_mode", isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
    )
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "adamw_mode": bool(adamw),
        "bias_correction": bool(group.get("bias_correction", True)),
    }


def one_state_hyper(kind: str, group: dict[str, Any]) -> dict[str, Any]:
    """Kernel hyperparameters of one Adagrad or Lion parameter group (read live, as for Adam)."""
    if kind == "adagrad":
        keys = ("lr", "lr_decay", "eps", "weight_decay")
        return {k: float(group[k]) for k in keys}
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "weight_decay": float(group["weight_decay"]),
    }


def kernel_kind(optimizer: torch.optim.Optimizer, buffers: Sequence[FlatBuffer]) -> Literal["lamb", "plain"] | None:
    """Which kernel step ``optimizer`` needs under ZeRO: "lamb" (the shard-aware LAMB kernels),
    "plain" (the Adam, Adagrad or Lion kernel) or None when its own ``step()`` is right.
    ``ValueError`` for an Adam group the offloaded kernel cannot step (before training starts)."""
    if isinstance(optimizer, lamb_family()):
        return "lamb"
    if any(b.master.dtype == torch.float64 for b in buffers):
        return None  # the compiled Adam kernels step fp32 masters; torch's step takes float64 ones
    if not any(b.offloaded for b in buffers):
        return _kind_for_host_masters(optimizer, buffers)
    # Offloaded: the compiled kernel for exactly Adam/AdamW, Adagrad or ops.Lion (a subclass may
    # add to step(), so it steps itself), else the user's optimizer runs its own step() on the host masters, as
    # DeepSpeed does with zero_force_ds_cpu_optimizer=False.
    if step_replaced(optimizer):
        return None
    if one_state_kind(optimizer) is not None:
        if any(g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
            return None
        return "plain"
    if type(optimizer) not in adam_family() or any(
        g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups
    ):
        return None
    for param_group in optimizer.param_groups:
        kernel_hyper(optimizer, param_group)  # reject amsgrad/maximize before training starts
    return "plain"


def _kind_for_host_masters(optimizer: torch.optim.Optimizer, buffers: Sequence[FlatBuffer]) -> Literal["plain"] | None:
    """Without offload, torch's Adam/AdamW on fp32 masters in host memory (CPU training) also runs
    the compiled kernel: one pass instead of torch's several over the slice (measured ~50 ms ->
    ~15 ms per step on a 14M-parameter GPT, 2 ranks), and it writes the 16-bit parameters in the
    same pass. Only when the kernel is compiled (the readable fallback is slower than torch)."""
    from lightning_zero.ops import compiled

    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not compiled() or not buffers:
        return None
    if step_replaced(optimizer):
        return None
    if any(b.master.device.type != "cpu" or b.master.dtype != torch.float32 for b in buffers):
        return None
    if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
        return None
    return "plain"
