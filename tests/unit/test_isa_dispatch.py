"""The compiled CPU ops offer exactly the ISA paths this machine's CPU has.

``csrc/cpu/isa.cpp`` compiles three paths into one binary and offers those the CPU supports, best
first: AVX-512 (F, BW, VL, DQ), AVX2 (with FMA and F16C), and the portable scalar path always. This
test derives the same list from the kernel's cpuid flags, so it checks the dispatch on whatever
machine runs the suite (an AVX2-only AMD EPYC: ``['avx2', 'scalar']``; an AMX Xeon: all three).
"""

import pytest

from lightning_zero.ops import _load

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def test_compiled_cpu_ops_offer_the_isas_cpuid_reports():
    flags = _cpu_flags()
    if not _load.compiled() or not flags:
        pytest.skip("compiled ops or /proc/cpuinfo flags unavailable (the reference path is used)")
    expected = [isa for isa, needs in (("avx512", AVX512), ("avx2", AVX2)) if needs <= flags] + ["scalar"]
    assert _load.supported_isas() == expected
    assert _load.available()["cpu_adam"] == expected[0]  # auto takes the best path
