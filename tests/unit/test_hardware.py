"""Precision by capability: the cpuid check, "auto" resolution and the slow-bf16 warning.

The flags are mocked, so these run the same on every machine; no assertion depends on a timing.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lightning_zero import hardware
from recipes.common.cli import RecipeTrainer, _run_device

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
WITH_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw amx_bf16 amx_tile\n"
WITH_AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
AVX512_NO_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512vl\n"


def _cpuinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "cpuinfo"
    if text is not None:
        path.write_text(text)
    real = hardware.cpu_flags
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=path: real(cpuinfo))
    monkeypatch.setattr(hardware.sys, "platform", "linux")


@pytest.mark.parametrize(
    ("text", "native"), [(AVX2_ONLY, False), (WITH_AMX, True), (WITH_AVX512_BF16, True), (AVX512_NO_BF16, False)]
)
def test_cpu_native_bf16_from_flags(monkeypatch, tmp_path, text, native):
    _cpuinfo(monkeypatch, tmp_path, text)
    assert hardware.native_bf16("cpu") is native
    assert hardware.auto_precision(torch.device("cpu")) == ("bf16-mixed" if native else "32-true")


@pytest.mark.parametrize(("capability", "native"), [("AVX2", False), ("AVX512", True), ("DEFAULT", False)])
def test_cpu_without_flag_list_uses_torch_capability(monkeypatch, tmp_path, capability, native):
    _cpuinfo(monkeypatch, tmp_path, None)  # no /proc/cpuinfo
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert hardware.native_bf16("cpu") is native


@pytest.mark.parametrize("supported", [True, False])
def test_cuda_native_bf16(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert hardware.native_bf16("cuda") is supported
    assert hardware.auto_precision("cuda") == ("bf16-mixed" if supported else "32-true")


def test_resolve_only_touches_auto(monkeypatch, tmp_path):
    _cpuinfo(monkeypatch, tmp_path, AVX2_ONLY)
    assert hardware.resolve_precision("auto", "cpu") == "32-true"
    for given in ("bf16-mixed", "32-true", 16, None):
        assert hardware.resolve_precision(given, "cpu") == given


def test_recipe_trainer_resolves_auto(monkeypatch, tmp_path):
    _cpuinfo(monkeypatch, tmp_path, WITH_AMX)
    trainer = RecipeTrainer(precision="auto", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    _cpuinfo(monkeypatch, tmp_path, AVX2_ONLY)
    trainer = RecipeTrainer(precision="auto", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert trainer.precision_plugin.precision == "32-true"
    assert _run_device("cpu").type == "cpu"


def _slow_bf16_warnings(monkeypatch, tmp_path, text, precision, device="cpu", calls=2):
    _cpuinfo(monkeypatch, tmp_path, text)
    hardware._warn_slow_bf16.cache_clear()
    probes = []
    monkeypatch.setattr(hardware, "matmul_ratio", lambda: probes.append(1) or 37.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            hardware.warn_if_slow_bf16(precision, device)
    hardware._warn_slow_bf16.cache_clear()
    return [str(w.message) for w in caught], len(probes)


def test_slow_bf16_warns_once_with_the_ratio(monkeypatch, tmp_path):
    messages, probes = _slow_bf16_warnings(monkeypatch, tmp_path, AVX2_ONLY, "bf16-mixed")
    assert probes == 1 and len(messages) == 1
    assert "37.5x" in messages[0] and "bf16-mixed" in messages[0]


@pytest.mark.parametrize(
    ("text", "precision", "device"),
    [(WITH_AMX, "bf16-mixed", "cpu"), (AVX2_ONLY, "32-true", "cpu"), (AVX2_ONLY, "bf16-mixed", "meta")],
)
def test_no_warning_where_bf16_is_fine(monkeypatch, tmp_path, text, precision, device):
    messages, probes = _slow_bf16_warnings(monkeypatch, tmp_path, text, precision, device)
    assert messages == [] and probes == 0


def test_no_probe_off_rank_zero(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware.rank_zero_only, "rank", 1)
    messages, probes = _slow_bf16_warnings(monkeypatch, tmp_path, AVX2_ONLY, "bf16-mixed")
    assert messages == [] and probes == 0


def test_matmul_ratio_is_a_positive_ratio():
    # the real probe on this machine: only its form is checked (no timing assertion)
    assert hardware.matmul_ratio(size=16, repeats=1) > 0
