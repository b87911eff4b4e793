"""Weight averaging (EMA, SWA) of a stage-3 model: the averaged copy is sharded like the model.

Lightning's ``WeightAveraging`` (``EMAWeightAveraging``), ``StochasticWeightAveraging`` and a user's
``torch.optim.swa_utils.AveragedModel`` keep a copy of the model and update it from
``model.parameters()`` between steps, where a stage-3 parameter is a 1-D view of this rank's piece
of it. Every operation they perform on it is elementwise (the average, the swap in and out for
validation, the copy into the model at the end of training), so a copy that holds, for each sharded
parameter, the same piece (same offset, same length) is exactly this rank's part of the copy DDP
would hold: no communication per update, and ``4 * numel / N`` bytes (fp32) per rank for the
averaged sharded parameters instead of ``4 * numel``.

:func:`shard_averaged_copies` finds the copies in the trainer's callbacks (``_average_model`` of
Lightning's callbacks, any ``AveragedModel`` attribute of a callback) and cuts each whole parameter
that corresponds to a sharded one down to its piece (a copy made by ``deepcopy`` of the sharded model,
after setup, holds the pieces already). Each such copy's ``state_dict()`` gives the whole tensors
(one all-reduce per sharded parameter: a collective, which Lightning's checkpointing calls on every
rank) and its ``load_state_dict()`` takes whole tensors and keeps the piece, so checkpoints hold
what DDP's hold.

What does not work: running the averaged copy's own forward (its sharded parameters are pieces);
swap it into the model (as ``WeightAveraging`` does for validation) or save and consolidate it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero import comm

if TYPE_CHECKING:
    from lightning_zero.zero.engine import ZeroEngine

_PIECES = "_lightning_zero_pieces"  # on a copy's submodule: {param name: (full shape, param offset)}
_GROUP = "_lightning_zero_group"  # on a copy's submodule: the data-parallel group of its state-dict collectives
_DONE = "_lightning_zero_averaged"  # on a prepared copy


def _copies(callbacks: list[Any]) -> Iterator[nn.Module]:
    """The averaged copies that ``callbacks`` hold: the ``module`` of every ``AveragedModel``
    attribute, and ``StochasticWeightAveraging``'s ``_average_model`` (a deepcopy of the model)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from torch.optim.swa_utils import AveragedModel

    for callback in callbacks:
        for value in list(vars(callback).values()):
            if isinstance(value, AveragedModel):
                yield value.module
            elif isinstance(value, nn.Module) and isinstance(callback, StochasticWeightAveraging):
                yield value


def _prefix(copy: nn.Module, module: nn.Module) -> str | None:
    """The name (with its dot) of the submodule of ``module`` that ``copy`` is a copy of (the same
    parameter names and shapes; ``""``: the whole model), or ``None`` when it is no copy of one, or
    holds the model's own parameters (a reference, not a copy: nothing to prepare)."""
    own = {id(p) for p in module.parameters()}
    mine = [(n, p) for n, p in copy.named_parameters(remove_duplicate=False)]
    if not mine or any(id(p) in own for _, p in mine):
        return None
    names = [n for n, _ in mine]
    for prefix, sub in module.named_modules():
        if [n for n, _ in sub.named_parameters(remove_duplicate=False)] == names:
            return f"{prefix}." if prefix else ""
    return None


def shard_averaged_copies(callbacks: list[Any], module: nn.Module, engine: ZeroEngine) -> list[nn.Module]:
    """Cut the averaged copies in ``callbacks`` down to this rank's pieces of the sharded parameters
    of ``module`` (see the module docstring); returns the copies it prepared. Idempotent. Local."""
    sharded: dict[int, tuple[torch.Size, int, int]] = {}  # id(param) -> (full shape, offset, numel)
    buffers = engine._all_buffers()
    for held in engine.held_params():
        # by the buffer, not by the parameter's shape: a rank whose piece is a whole 1-D parameter
        # must prepare it as the others do (the state-dict collectives run per sharded parameter)
        if not buffers[held.buffer].persistent:
            offset, _, numel = held.local if held.local is not None else (0, 0, 0)
            sharded[id(held.param)] = (held.shape, offset, numel)
    if not sharded:
        return []
    model_params = dict(module.named_parameters(remove_duplicate=False))  # tied weights under every name
    done = []
    for copy in _copies(callbacks):
        prefix = _prefix(copy, module)
        if getattr(copy, _DONE, False) or prefix is None:
            continue
        for sub_name, sub in copy.named_modules():
            pieces: dict[str, tuple[torch.Size, int]] = {}
            for name, param in sub._parameters.items():
                original = model_params.get(prefix + (f"{sub_name}.{name}" if sub_name else name))
                if param is None or original is None or id(original) not in sharded:
                    continue
                shape, offset, numel = sharded[id(original)]
                if param.shape == shape:
                    with torch.no_grad():
                        param.data = param.data.reshape(-1)[offset : offset + numel].clone()
                elif param.numel() != numel:
                    raise ValueError(
                        f"the averaged copy's parameter {sub_name}.{name} has shape {tuple(param.shape)}, neither the "
                        f"model's {tuple(shape)} nor this rank's piece ({numel} elements) of it under stage 3."
                    )
                pieces[name] = (shape, offset)
            if pieces:
                setattr(sub, _PIECES, pieces)
                setattr(sub, _GROUP, engine.group)
                sub.register_state_dict_post_hook(_whole_on_save)
                sub.register_load_state_dict_pre_hook(_piece_on_load)
        setattr(copy, _DONE, True)
        done.append(copy)
    return done


def _whole_on_save(sub: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` hook: each piece becomes the whole tensor (zeros outside the piece, summed over
    the data-parallel group: the pieces of all ranks tile the parameter). Call on all ranks."""
    group: comm.ProcessGroup = getattr(sub, _GROUP)
    for name, (shape, offset) in getattr(sub, _PIECES).items():
        key = prefix + name
        piece = destination.get(key)
        if piece is None:
            continue
        whole = torch.zeros(shape.numel(), dtype=piece.dtype, device=piece.device)
        whole[offset : offset + piece.numel()] = piece.detach().reshape(-1)
        comm.all_reduce(whole, group, label=f"averaged copy {key}")
        destination[key] = whole.reshape(shape)


def _piece_on_load(sub: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: a whole tensor becomes this rank's piece of it."""
    for name, (shape, offset) in getattr(sub, _PIECES).items():
        key = prefix + name
        value = state_dict.get(key)
        param = sub._parameters[name]
        if torch.is_tensor(value) and param is not None and tuple(value.shape) == tuple(shape):
            state_dict[key] = value.reshape(-1)[offset : offset + param.numel()]


def keep_edits_in_masters(engine: ZeroEngine) -> int:
    """At the end of training: weights a callback wrote into the model after the last step (the
    average that ``WeightAveraging`` / ``StochasticWeightAveraging`` copy in ``on_train_end``) reach
    the compute-dtype parameters only; where the fp32 master is a separate tensor (mixed precision,
    offload) it would keep the last trained values, and a checkpoint saved after fit would store
    those. Each slice whose compute copy no longer equals its master's rounding takes the edited
    values (at compute precision, as the model now holds them). Returns how many buffers changed.
    Not under the disk tiers (their masters or shards are not resident). Local."""
    if engine.swap is not None or engine.param_tier is not None:
        return 0
    changed = 0
    with torch.no_grad():
        for b in engine._all_buffers():
            if not b.separate_master or b.shard_tier is not None or b.param_shard.numel() == 0:
                continue
            if not torch.equal(b.param_shard, b.master.to(b.param_shard.dtype)):
                b.master.copy_(b.param_shard)
                changed += 1
    return changed
