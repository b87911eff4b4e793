"""``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` under every ZeRO stage: the sparse
gradient is reduced as the dense gradient it stands for, so SGD and Adagrad (whose update of a row
without gradient is no update, sparse or dense) train as under DDP, which all-reduces the sparse
gradients. ``torch.optim.SparseAdam`` is refused at setup: its lazy moments need to know which rows
got a gradient, which dense flat buffers cannot tell."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero.testing import run_ranks
from tests.helpers.models import VOCAB, make_loader
from tests.helpers.trainer import build_strategy, quiet_trainer

pytestmark = pytest.mark.distributed

STRATEGIES = {
    "zero1": {"stage": 1, "reduce_bucket_size": 40},
    "zero2": {"stage": 2, "reduce_bucket_size": 40},
    "zero3": {"stage": 3, "param_persistence_threshold": 0},
    "zero3_offload": {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
        "param_persistence_threshold": 0,
    },
}


class SparseLM(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.emb = nn.Embedding(VOCAB + 6, 13, sparse=True)  # rows 11..16 never looked up: no gradient
        self.bag = nn.EmbeddingBag(VOCAB, 13, mode="sum", sparse=True)
        self.head = nn.Linear(13, VOCAB)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        context = self.bag(tokens[:, :3])[:, None]  # (batch, 1, 13): a bag of the first tokens
        logits = self.head(torch.tanh(self.emb(tokens) + context))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5)
        if self.optimizer == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.1)
        return torch.optim.SparseAdam(self.parameters(), lr=1e-2)


def _fit(spec: Any, optimizer: str) -> SparseLM:
    import lightning_zero  # noqa: F401 - registers the strategy names

    pl.seed_everything(2, verbose=False)
    model = SparseLM(optimizer)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=build_strategy(spec),
        max_steps=5,
    )
    trainer.fit(model, make_loader(n=30, batch_size=3))
    return model


def _worker(rank: int) -> dict:
    out: dict[Any, Any] = {}
    for optimizer in ("sgd", "adagrad"):
        for name, spec in {"ddp": "ddp", **STRATEGIES}.items():
            model = _fit(spec, optimizer)
            out[name, optimizer] = {"losses": model.losses, "emb": model.emb.weight.detach().clone()}
    try:
        _fit(STRATEGIES["zero2"], "sparse_adam")
    except ValueError as error:
        out["sparse_adam"] = str(error)
    return out


def test_sparse_embeddings_train_like_ddp():
    for res in run_ranks(_worker, timeout=600):
        refused = res.pop("sparse_adam")
        assert "SparseAdam" in refused and "Adagrad" in refused, refused
        for (name, optimizer), run in res.items():
            ref = res["ddp", optimizer]
            # fp32: the dense sum of the two ranks' gradients is DDP's sparse sum, up to the
            # summation order (~1e-7 a step)
            torch.testing.assert_close(run["losses"], ref["losses"], rtol=1e-5, atol=0, msg=str((name, optimizer)))
            torch.testing.assert_close(run["emb"], ref["emb"], rtol=1e-5, atol=1e-6, msg=str((name, optimizer)))
            # the rows never looked up kept their initial values, as under DDP's sparse update
            assert torch.equal(run["emb"][VOCAB:], ref["emb"][VOCAB:]), (name, optimizer)
