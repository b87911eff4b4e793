"""torch.optim.Optimizer front ends of the compiled ops: CPUAdam, CPULamb (CPU tensors, SIMD C++),
FusedAdam, FusedLamb (multi-tensor, CUDA; also run on CPU tensors through the CPU kernels).

``step`` takes two optional keyword arguments the ZeRO engine uses to save passes over memory:
``grad_scale`` (gradients are multiplied by it inside the kernel: 1 / loss_scale x clip coefficient)
and ``param_copies`` (one bf16/fp16 tensor, or None, per parameter in param-group order, receiving
the updated parameter in the same pass). State: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` in
``state_dtype`` (fp32, or bf16 for half the state traffic at the cost of state precision).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_zero.ops import functional as F


def _check_hparams(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, state_dtype: torch.dtype
) -> None:
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"betas must be in [0, 1), got {betas}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")


class _AdamFamily(torch.optim.Optimizer):
    """Shared state handling; subclasses implement ``_step_group``."""

    _device_type: str | None = None  # "cpu" for the CPU optimizers: checked at construction

    def _step_group(self, group: dict, live: list, grad_scale: float | Tensor) -> None:
        raise NotImplementedError  # each optimizer class steps its groups with its own kernel

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        state_dtype: torch.dtype,
        **extra,
    ):
        _check_hparams(lr, betas, eps, weight_decay, state_dtype)
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, **extra
        )
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        for group in self.param_groups:
            for p in group["params"]:
                self._check_param(p)

    def _check_param(self, p: Tensor) -> None:
        if p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(
                f"{type(self).__name__} needs contiguous fp32 parameters (the fp32 "
                f"master copy), got {p.dtype} of shape {tuple(p.shape)}, "
                f"contiguous={p.is_contiguous()}"
            )
        if self._device_type and p.device.type != self._device_type:
            raise ValueError(
                f"{type(self).__name__} needs {self._device_type} parameters, got one "
                f"on {p.device}; use FusedAdam/FusedLamb on devices"
            )

    def _state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    def _with_copies(self, param_copies: Sequence[Tensor | None] | None):
        """Yield (group, [(param, copy or None), ...] for params that have a gradient)."""
        n = sum(len(g["params"]) for g in self.param_groups)
        if param_copies is not None and len(param_copies) != n:
            raise ValueError(
                f"param_copies has {len(param_copies)} entries for {n} parameters; pass "
                "one (or None) per parameter, in param-group order"
            )
        i = 0
        for group in self.param_groups:
            live = []
            for p in group["params"]:
                copy = None if param_copies is None else param_copies[i]
                i += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                live.append((p, copy))
            yield group, live

    @torch.no_grad()
    def step(
        self, closure=None, *, grad_scale: float | Tensor = 1.0, param_copies: Sequence[Tensor | None] | None = None
    ):
        """One optimizer step over every parameter with a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, live in self._with_copies(param_copies):
            if live:
                self._step_group(group, live, grad_scale)
        return loss


class CPUAdam(_AdamFamily):
    """Adam/AdamW on CPU fp32 parameters, one fused SIMD pass per parameter.

    Args: as torch.optim.AdamW (``adamw_mode=False`` gives torch.optim.Adam's L2 weight decay);
    ``state_dtype``: torch.float32 or torch.bfloat16 for exp_avg/exp_avg_sq.
    Parameters: contiguous fp32 CPU tensors, any shape; gradients fp32 (others are converted).
    """

    _device_type = "cpu"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        state_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction, state_dtype, adamw_mode=adamw_mode)

    def _step_group(self, group: dict, live: list, grad_scale: float | Tensor) -> None:
        for p, copy in live:
            state = self._state(p)
            state["step"] += 1
            F.cpu_adam_step(
                p.view(-1),
                p.grad.to(torch.float32).contiguous().view(-1),
                state["exp_avg"].view(-1),
                state["exp_avg_sq"].view(-1),
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=state["step"],
                adamw_mode=group["adamw_mode"],
                bias_correction=group["bias_correction"],
                grad_scale=float(grad_scale),
                param_copy=None if copy is None else copy.view(-1),
            )


class CPULamb(_AdamFamily):
    """LAMB (You et al. 2019) on CPU fp32 parameters, two SIMD passes per parameter.

    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * param;
    param -= lr * (||param|| / ||update||) * update (ratio 1 where either norm is 0; applied for
    every parameter, as in the paper and NVLAMB). Parameters and states as in :class:`CPUAdam`.
    """

    _device_type = "cpu"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        state_dtype: torch.dtype = torch.float32,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction, state_dtype)

    def _step_group(self, group: dict, live: list, grad_scale: float | Tensor) -> None:
        hp = dict(
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"],
        )
        for p, copy in live:
            state = self._state(p)
            state["step"] += 1
            whole = torch.tensor([0, p.numel()], dtype=torch.long)
            m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
            sq = F.cpu_lamb_moments(
                p.view(-1),
                p.grad.to(torch.float32).contiguous().view(-1),
                m,
                v,
                whole,
                step=state["step"],
                grad_scale=float(grad_scale),
                **hp,
            )
            F.cpu_lamb_apply(
                p.view(-1),
                m,
                v,
                whole,
                F.lamb_trust_ratio(sq),
                lr=group["lr"],
                step=state["step"],
                param_copy=None if copy is None else copy.view(-1),
                **hp,
            )


def _by_step(optimizer: _AdamFamily, live: list) -> dict[int, list]:
    """Parameters grouped by their step count (they differ only if some skipped a step)."""
    buckets: dict[int, list] = defaultdict(list)
    for p, copy in live:
        state = optimizer._state(p)
        state["step"] += 1
        buckets[state["step"]].append((p, copy, state))
    return buckets


def _device_scale(grad_scale: float | Tensor, device: torch.device) -> Tensor | None:
    if isinstance(grad_scale, Tensor):
        return grad_scale.to(device=device, dtype=torch.float32).reshape(1)
    return None if grad_scale == 1.0 else torch.full((1,), float(grad_scale), device=device)


def _lists(bucket: list):
    params = [p for p, _, _ in bucket]
    copies = [c for _, c, _ in bucket]
    if any(c is None for c in copies) and not all(c is None for c in copies):
        raise ValueError("param_copies: give a copy for every parameter of a group, or for none")
    return (
        params,
        [p.grad for p in params],
        [s["exp_avg"] for _, _, s in bucket],
        [s["exp_avg_sq"] for _, _, s in bucket],
        [] if copies[0] is None else copies,
    )


class FusedAdam(_AdamFamily):
    """Multi-tensor Adam/AdamW: all parameters of a group in a few kernel launches.

    Parameters: fp32 contiguous tensors on one device (the master weights); gradients fp32, bf16 or
    fp16; ``param_copies``: the 16-bit model weights to refresh in the same pass. ``grad_scale``
    may be a one-element device tensor (no host synchronisation). Args as :class:`CPUAdam`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction, torch.float32, adamw_mode=adamw_mode)

    def _step_group(self, group: dict, live: list, grad_scale: float | Tensor) -> None:
        for step, bucket in _by_step(self, live).items():
            params, grads, ms, vs, copies = _lists(bucket)
            F.fused_adam_step(
                params,
                grads,
                ms,
                vs,
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
                adamw_mode=group["adamw_mode"],
                bias_correction=group["bias_correction"],
                grad_scale=_device_scale(grad_scale, params[0].device),
                param_copies=copies,
            )


class FusedLamb(_AdamFamily):
    """Multi-tensor LAMB (see :class:`CPULamb` for the update); parameters as :class:`FusedAdam`."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, bias_correction, torch.float32)

    def _step_group(self, group: dict, live: list, grad_scale: float | Tensor) -> None:
        hp = dict(
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"],
        )
        for step, bucket in _by_step(self, live).items():
            params, grads, ms, vs, copies = _lists(bucket)
            sq = F.fused_lamb_moments(
                params, grads, ms, vs, step=step, grad_scale=_device_scale(grad_scale, params[0].device), **hp
            )
            F.fused_lamb_apply(
                params, ms, vs, F.lamb_trust_ratio(sq), lr=group["lr"], step=step, param_copies=copies, **hp
            )
