"""A tiny LightningModule with every hazard the ZeRO parity tests need, its data and variants.

Odd shapes (7, 15) so that flat-buffer slices cut through parameters; a weight tied between the
embedding and the output head; a frozen layer; a parameter never used in forward; modules called
twice in one forward; two optimizer parameter groups with their own hyperparameters; an LR
scheduler stepped every optimizer step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, WIDTH, HIDDEN, SEQ = 11, 15, 7, 9


class ParityModel(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw", lr: float = 1e-2, inject_inf_at: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = nn.Parameter(torch.randn(3, 5))
        self.optimizer_name = optimizer
        self.lr = lr
        self.inject_inf_at = inject_inf_at
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(tokens))
        for _ in range(2):  # the same modules called twice in one forward
            x = x + self.down(torch.tanh(self.up(x)))
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        if self.inject_inf_at is not None and self.global_step == self.inject_inf_at and self.global_rank == 0:
            loss = loss * float("inf")
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and n != "unused"]
        # The unused parameter sits in the no-decay group: with zero gradient, Adam then leaves it
        # unchanged under ZeRO, as DDP does by skipping parameters without a gradient.
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2 or n == "unused"]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": self.lr / 2}]
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr * 10, momentum=0.9)
        elif self.optimizer_name == "lamb":
            from lightning_zero.ops import CPULamb

            opt = CPULamb(groups, lr=self.lr, betas=(0.9, 0.99))
        elif self.optimizer_name == "adagrad":
            opt = torch.optim.Adagrad(groups, lr=self.lr, initial_accumulator_value=0.1)
        elif self.optimizer_name == "lion":
            from lightning_zero.ops import Lion

            opt = Lion(groups, lr=self.lr / 10, betas=(0.9, 0.99))
        elif self.optimizer_name == "cpuadam_bf16":  # ops.CPUAdam with bf16 moments
            from lightning_zero.ops import CPUAdam

            opt = CPUAdam(groups, lr=self.lr, betas=(0.9, 0.95), state_dtype=torch.bfloat16)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr)
        elif self.optimizer_name == "counting_adamw":
            opt = CountingAdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.1 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class CountingAdamW(torch.optim.AdamW):
    """A user's optimizer class: AdamW plus its own bookkeeping in step(), which must run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        return super().step(closure)


def make_loader(n: int = 48, batch_size: int = 3, seed: int = 1234, period: int | None = None) -> DataLoader:
    """``n`` random token rows; with ``period``, row i repeats row ``i % period``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    if period is not None:
        tokens = tokens[torch.arange(n) % period]
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, shuffle=False)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of the model's state dict (a snapshot to compare with later)."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


class ManualParityModel(ParityModel):
    """Manual optimization: two backward calls (two half-batches) per optimizer step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (tokens,) = batch
        opt = self.optimizers()
        opt.zero_grad()
        for half in (tokens[:2], tokens[2:]):
            logits = self(half)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), half[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()


class HazardModel(ParityModel):
    """Stage 3 hazards on top of ParityModel.

    ``branching``: odd micro-batches skip the second pass through up/down and truncate the sequence,
    so the module order (and the set of modules run) changes between steps.
    ``outside``: "raw" reads ``up.weight`` in training_step without gathering (gathered on use
    under stage 3, which must match DDP); "gathered" reads it inside ``gathered_parameters`` and adds a
    small regularizer, which must match DDP.
    """

    def __init__(self, branching: bool = False, outside: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.branching = branching
        self.outside = outside
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        short = self.branching and self.calls % 2 == 0
        if short:
            tokens = tokens[:, :5]
        x = self.frozen(self.embed(tokens))
        for _ in range(1 if short else 2):
            x = x + self.down(torch.tanh(self.up(x)))
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens)
        targets = tokens[:, 1 : logits.shape[1]]
        loss = F.cross_entropy(logits[:, : targets.shape[1]].reshape(-1, VOCAB).float(), targets.reshape(-1))
        self.losses.append(loss.item())
        if self.outside == "raw":
            loss = loss + 1e-3 * self.up.weight.float().pow(2).sum()
        elif self.outside == "gathered":
            strategy = self.trainer.strategy
            gathered = getattr(strategy, "gathered_parameters", None)
            if gathered is None:
                loss = loss + 1e-3 * self.up.weight.float().pow(2).sum()
            else:
                with gathered(self.up):
                    loss = loss + 1e-3 * self.up.weight.float().pow(2).sum()
        return loss


class BuiltInConfigureModel(pl.LightningModule):
    """Layers created in configure_model (meta device under stage 3, recorded and replayed into the
    shards), nothing tied."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        self.layers = nn.Sequential(
            nn.Embedding(VOCAB, 24),
            nn.Linear(24, 40),
            nn.GELU(),
            nn.Linear(40, 24),
            nn.LayerNorm(24),
            nn.Linear(24, VOCAB),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class StateEveryStep(pl.Callback):
    """Records the model's state after every training batch (weights unchanged by a skipped step)."""

    def __init__(self) -> None:
        self.states: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # stage 3: whole parameters only inside gathered_parameters (every rank runs this hook)
        gathered = getattr(trainer.strategy, "gathered_parameters", None)
        with gathered(pl_module) if gathered is not None else contextlib.nullcontext(), torch.no_grad():
            self.states.append(state(pl_module))
