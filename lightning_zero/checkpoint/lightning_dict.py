"""Lightning's own checkpoint dict in a sharded checkpoint (:mod:`~lightning_zero.checkpoint.save`):
what it holds for a ZeRO-managed optimizer (its parameter groups' hyperparameters and parameter
names, under :data:`SHARDED_OPTIMIZER_MARKER`: the states themselves are in the rank files), the
data loader state of the fit loop, and the dict rank 0 writes as ``lightning.pt`` (without the
tensors the rank files hold). The readers (:mod:`~lightning_zero.checkpoint.load`,
:mod:`~lightning_zero.checkpoint.consolidate`) recognise a sharded optimizer entry by the marker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero.checkpoint.pieces import param_names

if TYPE_CHECKING:
    from lightning_zero.zero import ZeroEngine

SHARDED_OPTIMIZER_MARKER = "lightning_zero.sharded"


def optimizer_groups(module: nn.Module, engine: ZeroEngine, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What Lightning stores for a ZeRO-managed optimizer: its parameter groups' hyperparameters and
    parameter names (the states themselves are in the rank files). Local, no communication."""
    names = param_names(module)
    groups = [
        {**group.hyper, "param_names": [names[id(p)] for p in group.params]} for group in engine.param_groups(optimizer)
    ]
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    return {"format": SHARDED_OPTIMIZER_MARKER, "class": type(optimizer).__name__, "param_groups": groups}


def loader_state(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The fit loop's stateful train data loader states in Lightning's dict (``None`` without)."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")


def lightning_state(checkpoint: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    """Lightning's dict as rank 0 writes it: without the tensors that the rank files hold, and with
    every ZeRO optimizer's parameter names of all ranks (each pipeline stage holds some)."""
    state = dict(checkpoint)
    state["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in merged["alias_of"]}
    if "optimizer_states" in checkpoint:
        state["optimizer_states"] = []
        for saved, names in zip(checkpoint["optimizer_states"], merged["optimizer_names"], strict=True):
            if names is not None and saved.get("format") == SHARDED_OPTIMIZER_MARKER:
                groups = [
                    {**group, "param_names": group_names}
                    for group, group_names in zip(saved["param_groups"], names, strict=True)
                ]
                saved = {**saved, "param_groups": groups}
            state["optimizer_states"].append(saved)
    return state
