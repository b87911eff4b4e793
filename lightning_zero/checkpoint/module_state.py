"""A set-up model's own ``load_state_dict`` and ``state_dict`` with full (unsharded) state dicts.

Programs written for DDP load pretrained weights with ``model.load_state_dict(full_state_dict)`` after
the strategy set the model up (LitGPT does for every strategy but FSDP; a LightningModule does in
``setup`` or ``on_fit_start``), and read ``model.state_dict()`` to export weights. Under ZeRO the
weights the optimizer steps are the fp32 masters in the engine's shards, and under stage 3 a
parameter outside a forward holds only its piece, so torch's own code would fail ("size mismatch")
or load the parameter but not its master (the next step would put the old weights back).

:class:`FullStateDictHooks` puts hooks on every submodule of the model:

* ``load_state_dict`` (any submodule, any stage): each partitioned parameter found in the state dict
  is checked against its full shape, and once the whole call has gone through the module tree each
  rank copies its own piece of each into its master and parameter shard (no communication; the
  state dict is in every rank's memory, as under DDP, where every rank loads it; a lazily loaded one,
  Lightning's ``lazy_load`` as LitGPT uses, is read one parameter at a time). Parameters
  that are whole (stages 1/2, small stage-3 ones) are also copied by torch as usual. As FSDP's
  ``set_model_state_dict`` with a full state dict; ``strict`` and the returned missing and unexpected
  keys are torch's.
* ``state_dict`` (stage 3, when ``full_state_dict``): every partitioned parameter gathered into a
  whole tensor on every rank (one flat buffer at a time, in the dtype a checkpoint stores: the fp32
  master under mixed precision), as FSDP's full state dict; a collective, so call it on all ranks.
  The checkpoint code's own reads (``keep_vars=True`` or inside ``placeholders_allowed``) are left
  alone.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_zero.zero import HeldParam, placeholders_allowed, placeholders_ok

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from lightning_zero.zero import ZeroEngine


class FullStateDictHooks:
    """Full state dicts through ``module.load_state_dict`` / ``module.state_dict`` of a set-up model.

    Args:
        module: the model the engine was built for.
        engine: its engine.
        full_state_dict: whether ``state_dict()`` gathers the partitioned parameters (stage 3; at
            stages 1/2 the parameters are whole and ``state_dict()`` is torch's).
    """

    def __init__(self, module: nn.Module, engine: ZeroEngine, full_state_dict: bool) -> None:
        self.engine = engine
        self._held: dict[int, HeldParam] = {id(h.param): h for h in engine.held_params()}
        self._loading: nn.Module | None = None  # the module load_state_dict was called on
        self._pending: dict[int, torch.Tensor] = {}  # id(param) -> its full value in the state dict
        self._loaded: list[str] = []  # their keys, popped from torch's copy of the state dict
        self._saving: nn.Module | None = None
        self._whole: dict[int, torch.Tensor] = {}
        self._token: Any = None
        self._handles: list[RemovableHandle] = []
        for sub in module.modules():
            self._handles.append(sub.register_load_state_dict_pre_hook(self._pre_load))
            self._handles.append(sub.register_load_state_dict_post_hook(self._post_load))
            if full_state_dict:
                self._handles.append(sub.register_state_dict_pre_hook(self._pre_save))
                # (a partial: torch marks a post hook with an attribute, which a bound method refuses)
                self._handles.append(sub.register_state_dict_post_hook(functools.partial(_call, self._post_save)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _released(self, param: nn.Parameter) -> bool:
        held = self._held.get(id(param))
        return held is not None and tuple(param.shape) != tuple(held.shape)

    # -- load_state_dict ---------------------------------------------------------------------

    def _pre_load(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if prefix == "" and self._loading is None:
            self._loading, self._pending, self._loaded = module, {}, []
        if self._loading is None:
            return  # a load_state_dict of a submodule's own, inside another hook
        for name, param in module._parameters.items():
            key = prefix + name
            held = self._held.get(id(param)) if param is not None else None
            if param is None or held is None or key not in state_dict:
                continue
            value = state_dict[key]
            shape = getattr(value, "shape", None)  # a tensor, or a lazily loaded one (Lightning's lazy_load)
            if shape is None or tuple(shape) != tuple(held.shape):
                shape = type(value).__name__ if shape is None else tuple(shape)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                    f"the shape in current model is {tuple(held.shape)}."
                )
                state_dict.pop(key)
                continue
            self._pending[id(param)] = value
            if tuple(param.shape) != tuple(held.shape):  # a stage-3 piece: torch must not copy into it
                state_dict.pop(key)
                self._loaded.append(key)

    def _post_load(self, module: nn.Module, incompatible: Any) -> None:
        if module is not self._loading:
            return
        pending, loaded = self._pending, set(self._loaded)
        self._loading, self._pending, self._loaded = None, {}, []
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in loaded]
        if not pending:
            return

        def read(held: HeldParam, param_offset: int, numel: int) -> torch.Tensor | None:
            value = pending.get(id(held.param))
            if value is None:
                return None
            return _materialize(value).detach().reshape(-1)[param_offset : param_offset + numel]

        self.engine.load_pieces_local(read)

    # -- state_dict ------------------------------------------------------------------------------

    def _pre_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if prefix != "" or self._saving is not None or keep_vars or placeholders_ok():
            return
        if not any(self._released(p) for p in module.parameters()):
            return  # inside a forward or gathered_parameters: torch's state dict is whole already
        self._saving = module
        self._whole = self.engine.full_params(keep=True)  # a collective: every rank, one buffer at a time
        self._token = placeholders_allowed()
        self._token.__enter__()  # the guard lets the placeholders through; _post_save replaces them

    def _post_save(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if self._saving is None:
            return
        for name, param in module._parameters.items():
            key = prefix + name
            if param is not None and id(param) in self._whole and key in state_dict and self._released(param):
                state_dict[key] = self._whole[id(param)]
        if module is self._saving:
            token, self._token, self._saving, self._whole = self._token, None, None, {}
            token.__exit__(None, None, None)


def _materialize(value: Any) -> torch.Tensor:
    """A tensor from a state-dict value: Lightning's ``lazy_load`` gives ``_NotYetLoadedTensor`` objects,
    read from the file here, one parameter at a time."""
    if torch.is_tensor(value):
        return value
    load = getattr(value, "_load_tensor", None)
    return load() if load is not None else torch.as_tensor(value)


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)
