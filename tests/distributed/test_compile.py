"""``torch.compile`` under ZeRO (issue 19): a LightningModule whose model is compiled in
``configure_model`` (as Lightning documents) trains at stages 1, 2 and 3 with the losses of the same
model uncompiled, and the graph breaks are counted (the README's "torch.compile" table).

Tolerance: the compiled kernels (inductor's C++ code on the CPU) fuse and reorder fp32 arithmetic,
so losses agree to rounding, not bitwise; 1e-5 relative is the issue's bound (measured gaps are
printed by the test and are of order 1e-7). The model is a 2-layer MLP with odd widths (7, 15) and
few steps, because compiling on 2 shared CPU cores takes tens of seconds per graph.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from models import build_strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.testing import run_ranks

pytestmark = pytest.mark.distributed

STAGES = {
    1: {"stage": 1},
    2: {"stage": 2, "reduce_bucket_size": 50},
    # every parameter sharded, buckets cutting through them: the gather hooks run for each Linear
    3: {"stage": 3, "reduce_bucket_size": 30, "param_persistence_threshold": 0},
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(15, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class CompiledModel(pl.LightningModule):
    def __init__(self, compile: bool) -> None:
        super().__init__()
        self.compile = compile
        self.losses: list[float] = []

    def configure_model(self) -> None:
        self.model = MLP()
        if self.compile:
            self.model = torch.compile(self.model)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(spec, compile: bool) -> list[float]:
    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 15, generator=g), torch.randint(0, 3, (24,), generator=g))
    model = CompiledModel(compile)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=build_strategy(spec),
        precision="32-true",
        max_steps=4,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=3))
    return model.losses


def _worker(rank: int, spec) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _fit(spec, compile=False)
    compiled = _fit(spec, compile=True)
    return {
        "eager": eager,
        "compiled": compiled,
        "graph_breaks": {str(k): v for k, v in counters["graph_break"].items()},
        "frames": dict(counters["frames"]),
        "recompiles": dict(counters["recompiles"]) if "recompiles" in counters else {},
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_forward_matches_eager(stage):
    results = run_ranks(_worker, STAGES[stage], timeout=900)
    for res in results:
        print(f"stage {stage}: graph breaks {res['graph_breaks']}, frames {res['frames']}")
        eager, compiled = torch.tensor(res["eager"]), torch.tensor(res["compiled"])
        assert len(eager) == 8
        print(f"stage {stage}: largest relative loss gap {((compiled - eager).abs() / eager.abs()).max():.2e}")
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
        breaks = sum(res["graph_breaks"].values())
        if stage < 3:
            assert breaks == 0 and res["frames"]["total"] == 1  # one graph for the whole MLP
        else:
            # One graph break at each module whose parameters stage 3 gathers (fc1, fc2): the gather
            # hook runs eagerly between the compiled pieces; nothing else breaks the graph.
            assert breaks == 2, res["graph_breaks"]
            assert all("GatherCoordinator._make_pre_forward" in reason for reason in res["graph_breaks"])
