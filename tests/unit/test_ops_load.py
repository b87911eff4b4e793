"""Loader, path selection, fallback, argument checks and torch.library.opcheck of the ops."""

import warnings

import pytest
import torch

import lightning_zero.ops as ops
from lightning_zero.ops import CPUAdam, _load, reference
from lightning_zero.ops import functional as F
from lightning_zero.ops._load import ISA_ENV

needs_compiled = pytest.mark.skipif(not ops.compiled(), reason=f"lightning_zero._C not built: {_load._LOAD_ERROR}")


def test_available_reports_every_op():
    got = ops.available()
    assert set(got) == {"cpu_adam", "cpu_lamb", "fused_adam", "fused_lamb"}
    assert got["cpu_adam"] in {"avx512", "avx2", "scalar", "reference"}
    assert got["fused_adam"] in {"cuda", "reference", "unavailable"}


@needs_compiled
def test_env_var_forces_each_path(monkeypatch):
    for isa in _load.supported_isas() + ["reference"]:
        monkeypatch.setenv(ISA_ENV, isa)
        assert ops.available()["cpu_adam"] == isa
    assert _load.supported_isas()[-1] == "scalar"  # the portable path is always compiled


def test_env_var_rejects_unknown_path(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        ops.available()


def test_fallback_warns_once_and_computes_the_same(monkeypatch):
    """Without the compiled library the reference runs, after exactly one warning."""
    n = 1001
    args = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    expected = [torch.linspace(-1, 1, n), torch.zeros(n), torch.zeros(n)]
    reference.cpu_adam_step(
        expected[0],
        torch.ones(n),
        expected[1],
        expected[2],
        None,
        grad_scale=1.0,
        adamw_mode=True,
        bias_correction=True,
        **args,
    )
    monkeypatch.setattr(_load, "_LOAD_ERROR", "simulated: not built")
    monkeypatch.setattr(_load, "_warned", False)
    monkeypatch.delenv(ISA_ENV, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = [torch.linspace(-1, 1, n), torch.zeros(n), torch.zeros(n)]
            F.cpu_adam_step(got[0], torch.ones(n), got[1], got[2], **args)
    assert len([w for w in caught if "reference" in str(w.message)]) == 1
    assert ops.available()["cpu_adam"] == "reference"
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    monkeypatch.setenv(ISA_ENV, "avx2")  # asking for a compiled path that is missing is an error
    with pytest.raises(ValueError, match="not built"):
        ops.available()


@needs_compiled
def test_bad_input_raises_value_error_with_numbers():
    p, m, v = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    with pytest.raises(ValueError, match="9 elements but param has 10"):
        F.cpu_adam_step(p, torch.zeros(9), m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="step counts from 1"):
        F.cpu_adam_step(p, torch.zeros(10), m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=0)
    with pytest.raises(ValueError, match="end at param.numel"):
        F.cpu_lamb_moments(
            p,
            torch.zeros(10),
            m,
            v,
            torch.tensor([0, 4, 9]),
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.0,
            step=1,
        )


def test_optimizer_rejects_non_fp32_params():
    with pytest.raises(ValueError, match="fp32"):
        CPUAdam([torch.zeros(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.zeros(3)], betas=(0.9, 1.0))


def _adam_args(n, state_dtype, copy):
    g = torch.Generator().manual_seed(0)
    copy_t = torch.zeros(n, dtype=torch.bfloat16) if copy else None
    return (
        torch.randn(n, generator=g),
        torch.randn(n, generator=g),
        torch.zeros(n, dtype=state_dtype),
        torch.zeros(n, dtype=state_dtype),
        copy_t,
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.01,
        3,
        True,
        True,
        0.5,
        "auto",
    )


@needs_compiled
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cpu_ops(state_dtype):
    n = 1037
    lz = torch.ops.lightning_zero
    torch.library.opcheck(lz.cpu_adam_step.default, _adam_args(n, state_dtype, copy=True))
    p, g, m, v = _adam_args(n, state_dtype, copy=False)[:4]
    offsets = torch.tensor([0, 500, n])
    hp = (0.9, 0.999, 1e-6, 0.01, 2, True)
    torch.library.opcheck(lz.cpu_lamb_moments.default, (p, g, m, v, offsets, *hp, 1.0, "auto"))
    torch.library.opcheck(lz.cpu_lamb_apply.default, (p, m, v, offsets, torch.ones(2), None, 1e-3, *hp, "auto"))


@needs_compiled
def test_opcheck_fused_ops_on_cpu():
    lz = torch.ops.lightning_zero
    ps = [torch.randn(37), torch.randn(5, 3)]
    gs = [torch.randn_like(p) for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    copies = [torch.zeros_like(p, dtype=torch.float16) for p in ps]
    hp = (0.9, 0.999, 1e-8, 0.0, 1)
    torch.library.opcheck(
        lz.fused_adam_step.default, (ps, gs, ms, vs, copies, torch.tensor([0.5]), 1e-3, *hp, True, True)
    )
    torch.library.opcheck(lz.fused_lamb_moments.default, (ps, gs, ms, vs, None, *hp, True))
    torch.library.opcheck(lz.fused_lamb_apply.default, (ps, ms, vs, torch.ones(2), [], 1e-3, *hp, True))
