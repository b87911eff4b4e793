"""FusedAdam / FusedLamb CUDA kernels against torch's fused CUDA AdamW and the reference LAMB.

Skipped (with the reason in the -ra summary) without a CUDA device. With a device, missing CUDA
kernels are a failure, not a skip: the build must produce them where nvcc and a CUDA torch exist.
Sizes: 278011 elements spans 5 chunks of 65536 (chunk tail), and 41 tensors exceed the 30 tensors
one launch carries at depth 5, so a tensor continues across launches.
"""

import pytest
import torch

import lightning_zero.ops as ops
from lightning_zero.ops import FusedAdam, FusedLamb, reference
from lightning_zero.ops import functional as F

pytestmark = pytest.mark.gpu  # skipped, with the reason, without a CUDA device (tests/conftest.py)
SHAPES = [(278011,)] + [(7, 15)] * 40
STEPS = 10
LR = 1e-3
# fp32 math in both, FMA in both, but a different order for the moments and the denominator: a
# few ulp per step, as on the CPU (see tests/unit/test_ops_adam.py). atol: 1e-6 of lr * STEPS.
RTOL, ATOL = 1e-6, 1e-6 * LR * STEPS


def make(device="cuda"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in SHAPES]


def grads_for(step, params, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.device, dtype) for p in params]


def test_cuda_kernels_are_built():
    assert ops.available()["fused_adam"] == "cuda", "rebuild with nvcc and a CUDA build of torch"


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fused_adam_matches_torch_fused(adamw_mode):
    ours, ref = make(), make()
    opt = FusedAdam(ours, lr=LR, weight_decay=0.01, adamw_mode=adamw_mode)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = torch_cls(ref, lr=LR, weight_decay=0.01, foreach=True)
    for step in range(1, STEPS + 1):
        for p, r, g in zip(ours, ref, grads_for(step, ours), strict=True):
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_fused_adam_bf16_grads_scale_and_copies(copy_dtype):
    """The mixed-precision step: bf16 model grads, fp32 master, 16-bit copies, on-device scale."""
    ours, ref = [p.detach() for p in make()], make()
    ms, vs = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    copies = [torch.empty_like(p, dtype=copy_dtype) for p in ours]
    ref_opt = torch.optim.AdamW(ref, lr=LR, foreach=True)
    scale = torch.tensor([0.25], device="cuda")  # stays on the device: no host synchronisation
    for step in range(1, STEPS + 1):
        grads = grads_for(step, ours, torch.bfloat16)
        F.fused_adam_step(
            ours,
            grads,
            ms,
            vs,
            lr=LR,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            step=step,
            grad_scale=scale,
            param_copies=copies,
        )
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.float() * 0.25
        ref_opt.step()
    for a, b, c in zip(ours, ref, copies, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=RTOL, atol=ATOL)
        assert torch.equal(c, a.to(copy_dtype))


def test_fused_lamb_matches_reference():
    ours = make()
    cpu = [p.detach().cpu() for p in ours]
    ms, vs = [torch.zeros_like(p) for p in cpu], [torch.zeros_like(p) for p in cpu]
    opt = FusedLamb(ours, lr=LR, weight_decay=0.01)
    hp = dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True)
    for step in range(1, STEPS + 1):
        grads = grads_for(step, ours)
        for p, g in zip(ours, grads, strict=True):
            p.grad = g
        opt.step()
        sq = reference.fused_lamb_moments(cpu, [g.cpu() for g in grads], ms, vs, None, step=step, **hp)
        reference.fused_lamb_apply(cpu, ms, vs, reference.lamb_trust_ratio(sq), [], lr=LR, step=step, **hp)
    # norms are summed by atomics in block order on the GPU and in fp64 on the CPU: ~1e-7 relative
    # on the trust ratio, within the tolerance above
    for a, b in zip(ours, cpu, strict=True):
        torch.testing.assert_close(a.detach().cpu(), b, rtol=RTOL, atol=ATOL)


def test_opcheck_cuda():
    lz = torch.ops.lightning_zero
    ps = [torch.randn(70001, device="cuda"), torch.randn(5, 3, device="cuda")]
    gs = [torch.randn_like(p, dtype=torch.bfloat16) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    copies = [torch.zeros_like(p, dtype=torch.bfloat16) for p in ps]
    hp = (0.9, 0.999, 1e-8, 0.0, 1)
    scale = torch.tensor([0.5], device="cuda")
    torch.library.opcheck(lz.fused_adam_step.default, (ps, gs, ms, vs, copies, scale, 1e-3, *hp, True, True))
    torch.library.opcheck(lz.fused_lamb_moments.default, (ps, gs, ms, vs, None, *hp, True))
    torch.library.opcheck(lz.fused_lamb_apply.default, (ps, ms, vs, torch.ones(2, device="cuda"), [], 1e-3, *hp, True))
