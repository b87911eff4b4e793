"""The plan's non-tensor resident terms of a CPU rank (:mod:`lightning_zero.plan.resident`): named,
in the peak on CPU ranks only, priced per distinct 16-bit matrix product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.plan import plan
from lightning_zero.plan.resident import DEFAULT, HostRuntime


@pytest.fixture(autouse=True)
def _no_process_group():
    """The planner makes its own fake process group; an earlier test may have left one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class TwoShapes(nn.Module):
    """Two linear layers of different shapes, and one of the first's shape again."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 20)
        self.b = nn.Linear(20, 12)
        self.c = nn.Linear(12, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _plan(device: str, precision: str = "bf16-mixed", runtime: HostRuntime | None = None):  # noqa: ANN202
    return plan(
        f"{__name__}:TwoShapes",
        2,
        zero=ZeroConfig(stage=2),
        device=device,
        precision=precision,
        inputs=[((4, 12), torch.float32)],
        host_runtime=runtime,
    )


def test_resident_terms_are_named_and_in_a_cpu_ranks_peak():
    cpu = _plan("cpu")
    # forward: a and c share a problem, b another (addmm); backward: the weight gradients of the three
    # (two distinct), the input gradients of c and b (a's input needs none): mm
    assert cpu.matmul_problems == 6
    assert cpu.resident == DEFAULT.code_bytes + 6 * DEFAULT.matmul_problem_bytes
    assert cpu.peak == cpu.total("device") + cpu.untracked + cpu.transient_peak + cpu.resident
    mine = HostRuntime(code_bytes=1000, matmul_problem_bytes=10)
    assert _plan("cpu", runtime=mine).resident == 1060
    # an accelerator's peak is its own memory: no host terms in it
    gpu = _plan("cuda")
    assert gpu.resident == 0 and gpu.peak == gpu.total("device") + gpu.untracked + gpu.transient_peak
    # fp32 products go to MKL, which keeps nothing per problem
    assert _plan("cpu", precision="32-true").matmul_problems == 0


def test_host_runtime_refuses_a_negative_count():
    with pytest.raises(ValueError, match="matmul_problems=-1"):
        DEFAULT.resident(-1)
