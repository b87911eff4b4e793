"""The memory estimate of ``lightning-zero report`` equals the ZeRO formulas of docs/stages.md."""

from __future__ import annotations

import pytest

from lightning_zero.cli import main
from lightning_zero.report import estimate, parse_count

PSI, N = 1_000_000, 8


@pytest.mark.parametrize(
    "stage,formula",
    [(0, 16 * PSI), (1, 4 * PSI + 12 * PSI / N), (2, 2 * PSI + 14 * PSI / N), (3, 16 * PSI / N)],
)
def test_mixed_precision_formulas(stage, formula):
    assert estimate(PSI, N, stage, "bf16-mixed").device_total == pytest.approx(formula)


def test_fp32_and_offload():
    assert estimate(PSI, N, 2, "32-true").device_total == pytest.approx(4 * PSI + 12 * PSI / N)
    off = estimate(PSI, N, 3, "bf16-mixed", offload_optimizer=True, offload_parameters=True)
    # device keeps only the 16-bit gradient slice; host: params 2/N, fp32 grads 4/N, master+moments 12/N
    assert off.device_total == pytest.approx(2 * PSI / N)
    assert off.host_total == pytest.approx(18 * PSI / N)


def test_parse_count_and_errors(capsys):
    assert parse_count("124M") == 124_000_000 and parse_count("1.5B") == 1_500_000_000
    with pytest.raises(ValueError, match="'lots'"):
        parse_count("lots")
    with pytest.raises(ValueError, match="stage=5"):
        estimate(PSI, N, 5)
    assert main(["report", "--params", "1.5B", "--dp", "8", "--stage", "3"]) == 0
    assert "total" in capsys.readouterr().out
    assert main(["report", "--params", "1B", "--stage", "2", "--offload-parameters"]) == 2
