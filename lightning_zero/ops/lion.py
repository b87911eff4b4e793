"""``Lion``: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

torch has no Lion, so this class is what a user passes to get it (it is also what the offloaded ZeRO
step recognises and maps to the compiled host kernel, see :mod:`lightning_zero.zero.step_kernels`)::

    c = beta1 * m + (1 - beta1) * g
    p = p - lr * (sign(c) + weight_decay * p)
    m = beta2 * m + (1 - beta2) * g

One state, ``exp_avg`` (fp32, or bf16 with ``state_dtype=torch.bfloat16``). Contiguous fp32 CPU
parameters step with the compiled single-pass kernel (``ops.functional.cpu_lion_step``: SIMD, torch's
threads); any other parameter (a GPU tensor, another dtype) with the readable reference in
``ops.reference.cpu_lion_step``. Typical hyperparameters: lr 3-10x smaller than AdamW's, weight
decay 3-10x larger.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_zero.ops import functional as F
from lightning_zero.ops import reference


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.float32,
    ):
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        if weight_decay < 0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Lion: state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(
                        p, dtype=self.state_dtype, memory_format=torch.contiguous_format
                    )
                fast = p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
                if fast:
                    grad = p.grad.float().contiguous()
                    F.cpu_lion_step(p, grad, state["exp_avg"], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd)
                else:
                    reference.cpu_lion_step(p, p.grad, state["exp_avg"], None, lr, beta1, beta2, wd, 1.0)
        return loss
