"""Pipelined ZeRO-Offload against the unpipelined path, on 2 CPU/gloo ranks.

Pipelined, each bucket's all-gather starts as soon as the host kernel has stepped it (and written
its 16-bit copy), while the next bucket steps; unpipelined, every bucket is stepped first and then
published. Each bucket's arithmetic is the same either way and an all-gather only moves bits, so
the two runs must agree bitwise: losses, parameters and optimizer states. Buckets of 40 elements
cut through the odd-shaped parameters, and ``allgather_bucket_size=100`` makes the publisher wait
for older gathers in the middle of the step.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from lightning_zero.testing import run_ranks
from tests.helpers.models import state
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

SPECS = {
    "zero1": {"stage": 1, "reduce_bucket_size": 40},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
    "zero3": {"stage": 3, "reduce_bucket_size": 40, "param_persistence_threshold": 10},
}


class _OptimizerStates(Callback):
    """Every rank's optimizer state tensors at the end of training (its own slices)."""

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def on_train_end(self, trainer, pl_module) -> None:
        for opt in trainer.optimizers:
            for entry in opt.state.values():
                self.states += [v.detach().clone() for v in entry.values() if torch.is_tensor(v)]


def _worker(rank: int, optimizer: str, precision: str, stages: list[str]) -> dict:
    from lightning_zero.zero import step_kernels

    pipelined_calls = []
    write_back = step_kernels.KernelStep._write_back

    def counting(self, b, copy, stepped):  # records that the pipelined path ran, buffer by buffer
        pipelined_calls.append(stepped is not None)
        return write_back(self, b, copy, stepped)

    step_kernels.KernelStep._write_back = counting  # type: ignore[method-assign]  # spying in a spawned rank
    out = {}
    for stage in stages:
        for pipeline in (True, False):
            pipelined_calls.clear()
            states = _OptimizerStates()
            spec = {**SPECS[stage], "offload_optimizer": True, "offload_pipeline": pipeline}
            spec["allgather_bucket_size"] = 100
            _, model = fit(
                spec,
                precision=precision,
                model_kwargs={"optimizer": optimizer},
                trainer_kwargs={"callbacks": [states]},
            )
            out[(stage, pipeline)] = {
                "losses": model.losses,
                "state": state(model),
                "optimizer": states.states,
                "pipelined": sorted(set(pipelined_calls)),
            }
    return out


@pytest.mark.parametrize(
    ("optimizer", "precision", "stages"),
    [
        ("adamw", "bf16-mixed", ["zero1", "zero2", "zero3"]),
        ("adamw", "32-true", ["zero2"]),
        ("adagrad", "bf16-mixed", ["zero2"]),
        ("lion", "bf16-mixed", ["zero2", "zero3"]),
    ],
)
def test_pipelined_offload_is_bitwise_unpipelined(optimizer, precision, stages):
    for res in run_ranks(_worker, optimizer, precision, stages):
        for stage in stages:
            piped, plain = res[(stage, True)], res[(stage, False)]
            # the spy saw each path: every bucket handed on as stepped, or none
            assert piped["pipelined"] == [True] and plain["pipelined"] == [False], (stage, piped, plain)
            # bitwise: same kernels on the same slices; the all-gather moves bits, in another order only
            assert piped["losses"] == plain["losses"], stage
            for key, value in plain["state"].items():
                assert torch.equal(piped["state"][key], value), (stage, key)
            assert len(piped["optimizer"]) == len(plain["optimizer"]) > 0
            for got, want in zip(piped["optimizer"], plain["optimizer"], strict=True):
                assert torch.equal(got, want), stage
