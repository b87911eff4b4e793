"""Adagrad and Lion on the host: the compiled one-pass kernels against torch.optim.Adagrad
and against the paper's Lion rule, on every ISA path this CPU has, and bitwise equal at 1 and 2 threads.

Sizes: 3 * 16384 + 11 elements give several 16384-element tiles and a tail shorter than any vector,
so every code path of the kernels (vector loop, zero-padded tail, tile split between threads) runs.
"""

import pytest
import torch

from lightning_zero.ops import ISA_ENV, Lion, compiled, functional, reference
from lightning_zero.ops._load import supported_isas

N = 3 * 16384 + 11
STEPS = 5
PATHS = [*supported_isas(), "reference"]


def _grads(step, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + step))


def _param(n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("weight_decay,lr_decay", [(0.0, 0.0), (0.01, 0.1)])
def test_adagrad_matches_torch(path, weight_decay, lr_decay, monkeypatch):
    monkeypatch.setenv(ISA_ENV, path)
    hyper = dict(lr=1e-2, lr_decay=lr_decay, eps=1e-10, weight_decay=weight_decay)
    ref = _param().requires_grad_()
    opt = torch.optim.Adagrad([ref], initial_accumulator_value=0.0, **hyper)
    p, s = _param(), torch.zeros(N)
    copy = torch.empty(N, dtype=torch.bfloat16)
    for step in range(STEPS):
        ref.grad = _grads(step)
        opt.step()
        # grad_scale: the kernel multiplies first; 2 * g * 0.5 is exact, so the result must not move
        functional.cpu_adagrad_step(p, 2 * _grads(step), s, step=step + 1, grad_scale=0.5, param_copy=copy, **hyper)
    # One fused multiply-add (kernel) against torch's separate multiply and add, and the division by
    # sqrt(sum) of a sum that differs in its last bit: a few ulp per step, 1e-6 relative after 5 steps.
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, opt.state[ref]["sum"], rtol=1e-6, atol=0)
    assert torch.equal(copy, p.bfloat16())  # the 16-bit copy is the updated fp32 param, rounded once


def _lion_by_the_paper(p, m, g, lr, beta1, beta2, wd):
    """Chen et al. 2023, Algorithm 2, literally (float64 so only the rule is being checked)."""
    c = beta1 * m + (1 - beta1) * g
    p = p - lr * (torch.sign(c) + wd * p)
    return p, beta2 * m + (1 - beta2) * g


def test_lion_reference_is_the_paper_rule():
    p, m = _param().double(), torch.zeros(N, dtype=torch.float64)
    q, n = _param(), torch.zeros(N)
    for step in range(STEPS):
        g = _grads(step)
        p, m = _lion_by_the_paper(p, m, g.double(), 1e-3, 0.9, 0.99, 0.1)
        reference.cpu_lion_step(q, g, n, None, 1e-3, 0.9, 0.99, 0.1, 1.0)
    # fp32 against float64 of the same rule: sign(c) is the same unless c is within an fp32
    # rounding of 0 (not the case for these draws), so only the decay term's rounding differs: ~1e-7.
    torch.testing.assert_close(q.double(), p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(n.double(), m, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_lion_kernel_matches_reference(path, state_dtype, monkeypatch):
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    p, m = _param(), torch.zeros(N, dtype=state_dtype)
    q, n = _param(), torch.zeros(N, dtype=state_dtype)
    copy = torch.empty(N, dtype=torch.float16)
    for step in range(STEPS):
        monkeypatch.setenv(ISA_ENV, path)
        functional.cpu_lion_step(p, 2 * _grads(step), m, grad_scale=0.5, param_copy=copy, **hyper)
        monkeypatch.setenv(ISA_ENV, "reference")
        functional.cpu_lion_step(q, _grads(step), n, **hyper)
    # sign(c) agrees (c differs by an fma rounding, far from 0 for these draws), so the params differ
    # only by fused vs separate roundings of p * (1 - lr wd) - lr * sign: ~1 ulp per step.
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # bf16 states are rounded from fp32 values that may differ by an ulp: one bf16 ulp (2**-8) of slack.
    torch.testing.assert_close(m.float(), n.float(), rtol=2**-7 if state_dtype == torch.bfloat16 else 1e-6, atol=1e-7)
    assert torch.equal(copy, p.half())


def test_lion_class_steps_and_checks_input():
    w = torch.nn.Parameter(_param(37).reshape(37, 1))
    opt = Lion([w], lr=1e-2, weight_decay=0.5)
    before = w.detach().clone()
    w.grad = _grads(0, 37).reshape(37, 1)
    opt.step()
    expect, _ = _lion_by_the_paper(
        before.double(), torch.zeros_like(before).double(), w.grad.double(), 1e-2, 0.9, 0.99, 0.5
    )
    # first step, m = 0: c = 0.1 g, so the update is exactly lr * sign(g) plus the decay term
    torch.testing.assert_close(w.detach().double(), expect, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="betas"):
        Lion([w], betas=(1.0, 0.9))


def _run(kind, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p, s = _param(), torch.zeros(N)
        for step in range(STEPS):
            if kind == "adagrad":
                functional.cpu_adagrad_step(
                    p, _grads(step), s, lr=1e-2, lr_decay=0.1, eps=1e-10, weight_decay=0.01, step=step + 1
                )
            else:
                functional.cpu_lion_step(p, _grads(step), s, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
        return p, s
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not compiled(), reason="lightning_zero._C not built: nothing compiled to thread")
@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("kind", ["adagrad", "lion"])
def test_bitwise_equal_at_1_and_2_threads(isa, kind, monkeypatch):
    # Bitwise, not a tolerance: every element is updated by one thread with the same instructions.
    monkeypatch.setenv(ISA_ENV, isa)
    p1, s1 = _run(kind, 1)
    p2, s2 = _run(kind, 2)
    assert torch.equal(p1, p2) and torch.equal(s1, s2)
