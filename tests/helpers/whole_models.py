"""Models for the whole-tensor optimizer tests: ParityModel (odd shapes, tied, frozen and unused
weights) with Muon + AdamW, Adafactor, a user's norm-scaled SGD and a mixed AdamW."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.models import VOCAB, ParityModel


class NormSGD(torch.optim.Optimizer):
    """A user's whole-tensor optimizer: SGD with momentum whose step is the momentum scaled to unit
    norm per tensor (the update of an element reads the whole tensor's norm)."""

    whole_tensor = True

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf / buf.norm().clamp_min(1e-12), alpha=-group["lr"])
        return loss


def _groups(model: ParityModel) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "unused"]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n == "unused"]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


class WholeModel(ParityModel):
    """``optimizer``: "adafactor", "normsgd", "mixed_adamw" (AdamW, its decay group stepped whole),
    or "muon" (manual optimization: Muon for the hidden matrices, AdamW for the rest)."""

    def __init__(self, optimizer: str = "adafactor", **kwargs: Any) -> None:
        super().__init__(optimizer=optimizer, **kwargs)
        self.automatic_optimization = optimizer != "muon"

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        (tokens,) = batch
        muon, adamw = self.optimizers()
        logits = self(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        muon.zero_grad()
        adamw.zero_grad()
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        return None

    def configure_optimizers(self):
        if self.optimizer_name == "adafactor":
            return torch.optim.Adafactor(_groups(self), lr=self.lr)
        if self.optimizer_name == "normsgd":
            return NormSGD(_groups(self), lr=self.lr)
        if self.optimizer_name == "mixed_adamw":
            groups = _groups(self)
            groups[0]["whole_tensor"] = True
            return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        hidden = [self.up.weight, self.down.weight]
        rest = [p for n, p in self.named_parameters() if n not in ("up.weight", "down.weight")]
        muon = torch.optim.Muon(hidden, lr=self.lr * 2, weight_decay=0.05)
        adamw = torch.optim.AdamW(rest, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)
        return [muon, adamw]


class LBFGSModel(ParityModel):
    """torch.optim.LBFGS over every trainable parameter (one group, no scheduler): a few inner
    iterations and a short history, so that a step evaluates the closure several times and the
    history wraps; ``line_search``: "strong_wolfe" or None (fixed step). ``losses`` gets one entry per
    closure evaluation. ``manual``: manual optimization, the closure of torch's documentation around
    ``manual_backward``. ``inf_at_call``: rank 0's loss is infinite at that closure evaluation (0-based)."""

    def __init__(
        self,
        line_search: str | None = "strong_wolfe",
        lbfgs_lr: float = 0.5,
        manual: bool = False,
        inf_at_call: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizer="lbfgs", **kwargs)
        self.line_search = line_search
        self.lbfgs_lr = lbfgs_lr
        self.automatic_optimization = not manual
        self.inf_at_call = inf_at_call

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            loss = super().training_step(batch, batch_idx)
            if len(self.losses) - 1 == self.inf_at_call and self.global_rank == 0:
                loss = loss * float("inf")
            return loss
        (tokens,) = batch
        opt = self.optimizers()

        def closure() -> torch.Tensor:
            opt.zero_grad()
            logits = self(tokens)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)
        return None

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.LBFGS(params, lr=self.lbfgs_lr, max_iter=4, history_size=3, line_search_fn=self.line_search)


class LBFGSRegressor(pl.LightningModule):
    """A small regression with LBFGS and its line search, on data where the ranks' batches give
    different losses (and, read per rank, different line-search decisions)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4, line_search_fn="strong_wolfe")


def regression_loader() -> DataLoader:
    x = torch.randn(32, 7, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
