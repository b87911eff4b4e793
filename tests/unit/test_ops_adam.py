"""CPUAdam / FusedAdam against torch.optim.AdamW and Adam, on every CPU path this machine runs.

Sizes are odd (278011 = 16 * 17375 + 11 elements, and a (7, 15) matrix) so that the SIMD tails
(shorter than one 8- or 16-lane vector) and the tile tails (278011 is not a multiple of the
16384-element tile) are exercised, not only the aligned bodies.
"""

import pytest
import torch

from lightning_zero.ops import CPUAdam, FusedAdam
from lightning_zero.ops._load import ISA_ENV, supported_isas

PATHS = supported_isas() + ["reference"]
SHAPES = [(278011,), (7, 15)]
STEPS = 30

# fp32 within 1e-6 relative: the kernels use FMA where torch rounds twice and multiply by
# 1/sqrt(bc2) where torch divides, so each step may differ by ~1 ulp of param (6e-8 relative);
# over 30 steps these mostly cancel (measured: < 6e-7 elementwise). For parameters near zero the
# error is a fraction of what the optimizer moved them instead: atol is 1e-6 of lr * STEPS.
LR = 1e-3
RTOL, ATOL = 1e-6, 1e-6 * LR * STEPS


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads_for(step, params):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def run(opt_cls, params, steps=STEPS, grad_scale=1.0, **kw):
    params = [p.clone().requires_grad_() for p in params]
    opt = opt_cls(params, **kw)
    for step in range(1, steps + 1):
        for p, g in zip(params, grads_for(step, params), strict=True):
            p.grad = g
        opt.step(grad_scale=grad_scale) if grad_scale != 1.0 else opt.step()
    return [p.detach() for p in params], opt


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(ISA_ENV, request.param)
    return request.param


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_cpu_adam_matches_torch(path, adamw_mode, weight_decay):
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    hp = dict(lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    ours, opt = run(CPUAdam, make_params(), adamw_mode=adamw_mode, **hp)
    ref, ref_opt = run(torch_cls, make_params(), foreach=True, **hp)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for p_ours, p_ref in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"], strict=True):
        # the states accumulate the same ~1 ulp per-step differences as the params
        torch.testing.assert_close(
            opt.state[p_ours]["exp_avg_sq"], ref_opt.state[p_ref]["exp_avg_sq"], rtol=1e-5, atol=1e-9
        )


def test_cpu_adam_without_bias_correction(path):
    ours, _ = run(CPUAdam, make_params(), lr=LR, bias_correction=False)
    # torch has no switch for it: without correction Adam is AdamW with lr scaled by sqrt(bc2)/bc1
    # and eps by 1/sqrt(bc2) per step, so compare with the reference written out by hand instead
    params = [p.clone() for p in make_params()]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    for step in range(1, STEPS + 1):
        for p, g, m, v in zip(params, grads_for(step, params), ms, vs, strict=True):
            m.lerp_(g, 0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
    for a, b in zip(ours, params, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_grad_scale_is_applied_in_the_pass(path):
    scale = 0.125 * 0.7  # unscale by 8, clip coefficient 0.7
    ours, _ = run(CPUAdam, make_params(), grad_scale=scale, lr=LR, weight_decay=0.01)
    params = [p.clone().requires_grad_() for p in make_params()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=True)
    for step in range(1, STEPS + 1):
        for p, g in zip(params, grads_for(step, params), strict=True):
            p.grad = g * scale  # the separate pass the fused one replaces
        opt.step()
    for a, b in zip(ours, params, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copy_out_equals_cast_of_updated_param(path, copy_dtype):
    params = [p.clone().requires_grad_() for p in make_params()]
    copies = [torch.empty_like(p, dtype=copy_dtype) for p in params]
    opt = CPUAdam(params, lr=1e-2)
    for step in range(1, 4):
        for p, g in zip(params, grads_for(step, params), strict=True):
            p.grad = g
        opt.step(param_copies=copies)
        for p, c in zip(params, copies, strict=True):
            # exact: the same fp32 value rounded to nearest even by the kernel and by torch
            assert torch.equal(c, p.detach().to(copy_dtype))


def test_bf16_states_match_reference(path, monkeypatch):
    ours, opt = run(CPUAdam, make_params(), lr=LR, weight_decay=0.01, state_dtype=torch.bfloat16)
    monkeypatch.setenv(ISA_ENV, "reference")
    ref, ref_opt = run(CPUAdam, make_params(), lr=LR, weight_decay=0.01, state_dtype=torch.bfloat16)
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert state["exp_avg"].dtype == torch.bfloat16
    # a 1-ulp fp32 difference can flip a bf16 rounding (one bf16 ulp, 2^-8 relative, in a state),
    # which moves that element's update by up to ~0.4% of lr per step: 1e-4 absolute after 30
    # steps of lr 1e-3 bounds it while still catching a wrong rounding rule (errors ~ lr * steps)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # and bf16 states are not a no-op: they differ from fp32 states
    fp32, _ = run(CPUAdam, make_params(), lr=LR, weight_decay=0.01)
    assert not torch.equal(fp32[0], ours[0])


def test_fused_adam_on_cpu_tensors_matches_torch(path):
    scale = torch.tensor([0.5])
    params = [p.clone().requires_grad_() for p in make_params()]
    ref = [p.clone().requires_grad_() for p in make_params()]
    opt = FusedAdam(params, lr=LR, weight_decay=0.02)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.02, foreach=True)
    for step in range(1, STEPS + 1):
        for p, r, g in zip(params, ref, grads_for(step, params), strict=True):
            p.grad, r.grad = g, g * 0.5
        opt.step(grad_scale=scale)
        ref_opt.step()
    for a, b in zip(params, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_bf16_grad_is_the_step_of_its_fp32_cast(path, state_dtype, grad_scale):
    # The disk tier hands bf16 gradient slices to the kernel as they are. Widening bf16 to fp32 is
    # exact and the kernel multiplies by grad_scale once, as torch's mul_ of the cast does, so the
    # step must be bitwise the one on grad.float() * grad_scale with grad_scale 1 (no tolerance).
    from lightning_zero.ops import functional as F

    n = SHAPES[0][0]  # odd: SIMD and tile tails
    g = torch.Generator().manual_seed(3)
    param = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).bfloat16() for _ in range(3)]
    runs = []
    for direct in (True, False):
        p, m, v = param.clone(), torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
        copy = torch.empty(n, dtype=torch.bfloat16)
        for step, grad in enumerate(grads, 1):
            hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, step=step, param_copy=copy)
            if direct:
                F.cpu_adam_step(p, grad, m, v, grad_scale=grad_scale, **hyper)
            else:
                F.cpu_adam_step(p, grad.float().mul_(grad_scale), m, v, **hyper)
        runs.append((p, m, v, copy))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", supported_isas())
def test_compiled_kernel_refuses_an_fp16_grad(isa, monkeypatch):
    # only bf16 is widened in the kernel; fp16 (and anything else) gets a ValueError naming the
    # dtypes it takes (the reference path takes any float gradient through grad.float())
    from lightning_zero.ops import functional as F

    monkeypatch.setenv(ISA_ENV, isa)
    p = torch.zeros(5)
    with pytest.raises(ValueError, match=r"grad \(float32 or bfloat16\) must be Float, got Half"):
        F.cpu_adam_step(
            p,
            torch.zeros(5, dtype=torch.half),
            torch.zeros(5),
            torch.zeros(5),
            lr=1e-3,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.0,
            step=1,
        )
