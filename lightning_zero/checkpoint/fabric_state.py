"""Fabric's ``state`` dict and the Trainer's checkpoint dict, one format for both strategies.

``fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 5})`` becomes the
dict the Trainer strategy saves (:func:`to_checkpoint`), written by :func:`~lightning_zero.checkpoint.save.save_sharded`::

    state_dict           the model (stage 3: only what ZeRO does not partition; the rest is in the rank files)
    optimizer_states     the optimizers of ``state``, in its order (ZeRO's: their parameter groups)
    lr_schedulers        the LR schedulers of ``state``, in its order
    OffloadPrecision     the loss scaler's state ("16-mixed")
    lightning_zero_fabric_keys   the names these had in ``state``, so that loading matches them by name
    step, ...            everything else as given (stateful objects: their ``state_dict()``)

:func:`restore` reads such a dict back into ``state`` (a Trainer checkpoint too: then the optimizers
and schedulers match by order, and ``global_step``, ``epoch``, ... come back in the remainder), and a
plain Fabric checkpoint of another strategy (``{"model": ..., "optimizer": ...}``) by its keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning
import torch
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from lightning_zero import comm
from lightning_zero.checkpoint import io as ckpt_io
from lightning_zero.checkpoint import load as ckpt_load
from lightning_zero.checkpoint import save as ckpt_save
from lightning_zero.checkpoint.consolidate import full_checkpoint, write_file
from lightning_zero.checkpoint.pieces import module_state_dict
from lightning_zero.precision import OffloadPrecision

if TYPE_CHECKING:
    from lightning_zero.zero import ZeroEngine

PRECISION_KEY = OffloadPrecision.__qualname__
"""Where the loss scaler's state is saved: the key Lightning gives the Trainer's precision plugin."""
FABRIC_KEYS = "lightning_zero_fabric_keys"
"""The names the model, optimizers and schedulers had in ``state`` (loading matches them)."""
_FORMAT_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", PRECISION_KEY, FABRIC_KEYS)


@dataclass(frozen=True)
class StateKeys:
    """Where the objects the format stores apart are in a Fabric ``state`` dict."""

    module: str | None
    """``None``: a save or load of optimizers (or plain values) alone."""
    optimizers: tuple[str, ...]
    schedulers: tuple[str, ...]

    def own(self, key: str) -> bool:
        return key == self.module or key in self.optimizers or key in self.schedulers


def split_state(state: dict[str, Any], module: nn.Module | None, optimizers: list[torch.optim.Optimizer]) -> StateKeys:
    """The keys of ``module`` (the one set up; it may be left out), of its ``optimizers`` and of the
    LR schedulers in ``state``; ``ValueError`` for another or a second module, a reserved key, a
    foreign optimizer."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) > 1 or (modules and state[modules[0]] is not module):
        raise ValueError(
            f"the state to save or load holds {len(modules)} module(s) ({modules}) that are not the one model set "
            "up with fabric.setup; ZeroStrategy saves that model (or none): e.g. {'model': model, 'optimizer': "
            "optimizer}."
        )
    reserved = [k for k in state if k in _FORMAT_KEYS]
    if reserved:
        raise ValueError(f"the state keys {reserved} are the checkpoint format's own; rename them.")
    optimizer_keys = tuple(k for k, v in state.items() if isinstance(v, torch.optim.Optimizer))
    unknown = [k for k in optimizer_keys if all(state[k] is not o for o in optimizers)]
    if unknown:
        raise ValueError(f"the optimizers {unknown} were not set up with this model (fabric.setup(model, optimizer)).")
    schedulers = tuple(k for k, v in state.items() if isinstance(v, LRScheduler))
    return StateKeys(modules[0] if modules else None, optimizer_keys, schedulers)


def to_checkpoint(
    state: dict[str, Any],
    keys: StateKeys,
    module: nn.Module,
    engine: ZeroEngine | None,
    stage: int,
    precision_state: dict[str, Any],
) -> dict[str, Any]:
    """The Trainer's checkpoint dict for ``state`` (see the module docstring); ``module``: the model
    set up (its weights are saved also when ``state`` leaves it out: the optimizer states are stored
    by parameter). Local."""
    checkpoint = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in state.items() if not keys.own(k)}
    checkpoint["state_dict"] = module_state_dict(module, engine, stage)
    checkpoint["optimizer_states"] = [_optimizer_state(module, engine, state[k]) for k in keys.optimizers]
    checkpoint["lr_schedulers"] = [state[k].state_dict() for k in keys.schedulers]
    checkpoint[FABRIC_KEYS] = {
        "model": keys.module,
        "optimizers": list(keys.optimizers),
        "schedulers": list(keys.schedulers),
    }
    if precision_state:
        checkpoint[PRECISION_KEY] = precision_state
    checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)  # the Trainer resumes from it
    return checkpoint


def _optimizer_state(module: nn.Module, engine: ZeroEngine | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if engine is None or not engine.manages(optimizer):
        return optimizer.state_dict()
    return ckpt_save.optimizer_groups(module, engine, optimizer)


def restore(
    checkpoint: dict[str, Any],
    state: dict[str, Any],
    keys: StateKeys,
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers: list[torch.optim.Optimizer],
    precision: OffloadPrecision,
    strict: bool,
) -> dict[str, Any]:
    """Load ``checkpoint`` (as :func:`~lightning_zero.checkpoint.load.load_checkpoint` returns it) into the
    objects of ``state``; plain values of ``state`` are replaced. Returns what is left of the checkpoint.
    ``module``: the model set up (loaded only when ``state`` holds it); ``optimizers``: every optimizer
    the engine was built with. Call on all ranks."""
    saved_keys = checkpoint.pop(FABRIC_KEYS, None) or {}
    if "state_dict" not in checkpoint:  # a Fabric checkpoint of another strategy (or a "full" one of ours)
        if keys.module is not None:
            if keys.module not in checkpoint:
                raise KeyError(
                    f"the checkpoint has no {keys.module!r} (it holds {sorted(checkpoint)}); load the keys it has, "
                    "e.g. fabric.load(path, {'optimizer': optimizer})."
                )
            checkpoint["state_dict"] = checkpoint.pop(keys.module)
        checkpoint.setdefault("state_dict", {})  # an optimizer alone: its states are whole tensors here
        checkpoint["optimizer_states"] = [checkpoint.pop(k) for k in keys.optimizers if k in checkpoint]
        checkpoint["lr_schedulers"] = [checkpoint.pop(k) for k in keys.schedulers if k in checkpoint]
        saved_keys = {"optimizers": list(keys.optimizers), "schedulers": list(keys.schedulers)}
    if keys.module is not None:
        ckpt_load.load_model(checkpoint, module, engine, optimizers, strict)
    if keys.optimizers:
        states = _saved_states(checkpoint, "optimizer_states", keys.optimizers, saved_keys.get("optimizers"))
        chosen = [state[k] for k in keys.optimizers]
        ckpt_load.load_optimizers({**checkpoint, "optimizer_states": states}, module, engine, chosen)
    if keys.schedulers:
        states = _saved_states(checkpoint, "lr_schedulers", keys.schedulers, saved_keys.get("schedulers"))
        for key, saved in zip(keys.schedulers, states, strict=True):
            state[key].load_state_dict(saved)
    if PRECISION_KEY in checkpoint:
        precision.load_state_dict(checkpoint.pop(PRECISION_KEY))
    for key in (ckpt_load.SHARDED_KEY, "state_dict", "optimizer_states", "lr_schedulers"):
        checkpoint.pop(key, None)
    for key, obj in state.items():
        if keys.own(key):
            continue
        if key not in checkpoint:
            if strict:
                raise KeyError(
                    f"the requested state contains a key {key!r} that the checkpoint does not have; "
                    "pass strict=False to skip it."
                )
            continue
        if isinstance(obj, _Stateful):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return checkpoint


def to_fabric_file(staging: Path, out: Path) -> None:
    """Turn the sharded save ``staging`` of a Fabric ``state`` into one file as Fabric's DDP (and
    FSDP's ``state_dict_type="full"``) writes it: ``{"model": whole state dict, "optimizer": the
    optimizer's own state_dict (whole tensors, torch's numbering), "step": ...}`` under the keys of
    ``state``, which ``torch.load`` reads. Built in this process's memory (the whole checkpoint). Local."""
    checkpoint = full_checkpoint(staging, trust_pickles=True)  # our own directory, just written
    names = checkpoint.pop(FABRIC_KEYS, {})
    out_state = {k: v for k, v in checkpoint.items() if k not in _FORMAT_KEYS and k != "pytorch-lightning_version"}
    if names.get("model") is not None:
        out_state[names["model"]] = checkpoint["state_dict"]
    out_state.update(zip(names.get("optimizers", []), checkpoint.get("optimizer_states", []), strict=True))
    out_state.update(zip(names.get("schedulers", []), checkpoint.get("lr_schedulers", []), strict=True))
    if PRECISION_KEY in checkpoint:
        out_state[PRECISION_KEY] = checkpoint[PRECISION_KEY]  # the loss scaler ("16-mixed"), read back by load
    write_file(out, functools.partial(torch.save, out_state))


def _saved_states(
    checkpoint: dict[str, Any], where: str, keys: tuple[str, ...], saved_keys: list[str] | None
) -> list[Any]:
    """The states saved under ``checkpoint[where]`` for the objects named ``keys``: by name when the
    checkpoint recorded the names (Fabric's), else in order (the Trainer's ``configure_optimizers``)."""
    saved = checkpoint.get(where)
    if saved is None:
        raise ValueError(
            f"the checkpoint has no {where} (a weights-only save?) but the state asks for {list(keys)}; "
            "load the model alone: fabric.load(path, {'model': model})."
        )
    if saved_keys is not None and all(k in saved_keys for k in keys):
        return [saved[saved_keys.index(k)] for k in keys]
    if len(saved) != len(keys):
        raise ValueError(
            f"the checkpoint has {len(saved)} {where} but the state to load holds {len(keys)} ({list(keys)}); "
            "give as many, in the order of the run that saved it."
        )
    return list(saved)


def save(
    path: Any,
    state: dict[str, Any],
    module: nn.Module,
    engine: ZeroEngine | None,
    set_up: list[torch.optim.Optimizer],
    precision: OffloadPrecision,
    *,
    stage: int,
    full: bool,
    rank: int,
) -> None:
    """``fabric.save(path, state)``: the Trainer strategy's sharded directory, or with ``full`` one file
    from rank 0 (:func:`to_fabric_file`). ``set_up``: the optimizers set up with the model. Call on all ranks."""
    keys = split_state(state, module, set_up)
    checkpoint = to_checkpoint(state, keys, module, engine, stage, precision.state_dict())
    optimizers = [state[k] for k in keys.optimizers]
    if not full:
        ckpt_save.save_sharded(checkpoint, path, module, engine, optimizers, precision.precision)
        return
    where = ckpt_io.location(path)
    if not where.local:
        raise ValueError(
            f"state_dict_type='full' writes a local file, not {where}: use state_dict_type='sharded' (the "
            "default, which writes to object stores too) or a local or shared path."
        )
    # A sharded save beside the file (every rank its pieces), which rank 0 turns into the one file.
    target = where.as_path()
    staging = target.with_name(f".{target.name}.zero-full-staging")
    ckpt_save.save_sharded(checkpoint, staging, module, engine, optimizers, precision.precision)
    error = None
    if rank == 0:
        try:
            to_fabric_file(staging, target)
        except Exception as exc:  # reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        finally:
            ckpt_save.remove_sharded(staging)
    errors = [e for e in comm.all_gather_object(error, None) if e]
    if errors:
        raise RuntimeError(f"writing the full checkpoint {target} failed on rank 0: {errors[0]}")
