"""Activation checkpointing on 2 CPU/gloo ranks: the same run with and without it, at
stages 1-3 and with tensor or pipeline parallelism.

Tolerance: fp32, 1e-6 relative. The recompute runs the same operations on the same inputs (and
the same dropout masks: the RNG state is restored for it), so the activations, gradients and
updates are the same numbers; 1e-6 leaves room only for a different summation order, never for a
missing gather (stage 3 would fail on an empty weight), a dropped gradient (~1e-2) or another
dropout mask (~1e-1). Each run also counts the forwards of the checkpointed blocks, so a test
that silently ran without checkpointing fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.testing import run_ranks
from tests.helpers.model_parallel import fit_pipelined, fit_tensor_parallel
from tests.helpers.models import VOCAB, state
from tests.helpers.trainer import fit

pytestmark = pytest.mark.distributed

WIDTH, HIDDEN = 15, 7  # odd: flat-buffer slices cut through parameters


class Block(nn.Module):
    """A residual MLP block with dropout (the recompute must draw the same mask)."""

    calls = 0  # forwards of any Block in this process (first forwards and recomputes)

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


def _model_cls() -> type:
    from tests.helpers.models import ParityModel

    class Blocks(ParityModel):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.frozen(self.embed(tokens))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            loss = F.cross_entropy(self(tokens)[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            return loss

    return Blocks


ZERO3 = {"param_persistence_threshold": 10, "prefetch_bucket_size": 200, "reduce_bucket_size": 40}
STEPS, ACCUMULATE = 4, 2


def _stage_worker(rank: int, stage: int, policy: str) -> dict:
    from lightning_zero import comm

    gathers = {"count": 0}
    all_gather = comm.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers["count"] += 1
        return all_gather(*args, **kwargs)

    comm.all_gather = counted  # the flat buffers' parameter all-gathers go through comm.all_gather
    out = {}
    for name, checkpointing in (("plain", None), ("checkpointed", None if policy == "none" else policy)):
        if checkpointing == "class":
            checkpointing = Block
        elif checkpointing == "callable":
            checkpointing = lambda module: isinstance(module, Block)  # noqa: E731 - the policy under test
        spec = {"stage": stage, "activation_checkpointing": checkpointing, **(ZERO3 if stage == 3 else {})}
        Block.calls, gathers["count"] = 0, 0
        _, model = fit(spec, max_steps=STEPS, accumulate=ACCUMULATE, model_cls=_model_cls())
        out[name] = {"losses": model.losses, "state": state(model), "calls": Block.calls, "gathers": gathers["count"]}
    comm.all_gather = all_gather
    return out


@pytest.mark.parametrize(("stage", "policy"), [(1, "class"), (2, "callable"), (3, "class")])
def test_checkpointing_matches_the_run_without_it(stage: int, policy: str):
    micro_batches = STEPS * ACCUMULATE
    for res in run_ranks(_stage_worker, stage, policy):
        plain, got = res["plain"], res["checkpointed"]
        assert plain["calls"] == 3 * micro_batches
        assert got["calls"] == 2 * 3 * micro_batches, "every block recomputes its forward once in backward"
        # Stage 3: the recompute gathers a block's parameters and keeps them for its backward, so
        # backward gathers nothing more than without checkpointing (releasing them after the
        # recompute would make backward gather them once more).
        assert got["gathers"] == plain["gathers"], (got["gathers"], plain["gathers"])
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
        assert set(got["state"]) == set(plain["state"]), "checkpoint keys stay those of the unwrapped model"
        for key, value in plain["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")


def _model_parallel_worker(rank: int, tensor: int, pipeline: int) -> dict:
    from recipes.gpt2.model import Block as GPTBlock

    counts = {"forwards": 0}
    original = GPTBlock.forward

    def counted(self, *args: Any, **kwargs: Any) -> Any:
        counts["forwards"] += 1
        return original(self, *args, **kwargs)

    GPTBlock.forward = counted  # type: ignore[method-assign]  # counts first forwards and recomputes
    out = {}
    try:
        for name, policy in (("plain", None), ("checkpointed", {GPTBlock})):
            counts["forwards"] = 0
            if pipeline > 1:
                res = fit_pipelined(
                    world=2, tensor=1, pipeline=2, stage=1, micro_batches=2, schedule="1f1b",
                    activation_checkpointing=policy,
                )  # fmt: skip
            else:  # sequence parallelism: the recompute repeats its gathers and reduce-scatters too
                res = fit_tensor_parallel(tensor, 1, stage=2, sequence_parallel=True, activation_checkpointing=policy)
                res["weights"] = res["params"]
            out[name] = {"losses": res["losses"], "norms": res["norms"], "weights": res["weights"]}
            out[name]["forwards"] = counts["forwards"]
    finally:
        GPTBlock.forward = original  # type: ignore[method-assign]
    return out


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)])
def test_checkpointing_with_model_parallelism_matches(tensor: int, pipeline: int):
    for res in run_ranks(_model_parallel_worker, tensor, pipeline):
        plain, got = res["plain"], res["checkpointed"]
        # Training forwards double (validation runs without grad: nothing to recompute).
        assert got["forwards"] > plain["forwards"] > 0, (got["forwards"], plain["forwards"])
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(plain[key]), rtol=1e-6, atol=0)
        for name, value in plain["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-6, atol=1e-7)


def test_invalid_policies_fail_at_construction():
    from lightning_zero import ZeroStrategy

    for bad in ("Block", [Block, "x"], [], 3):
        with pytest.raises(ValueError, match="activation_checkpointing"):
            ZeroStrategy(activation_checkpointing=bad)
    assert ZeroStrategy(activation_checkpointing=[Block]).config.activations.policy == frozenset({Block})
