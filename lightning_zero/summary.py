"""Lightning's model summary with ZeRO's real sizes.

Lightning's ``ModelSummary`` callback counts ``param.numel()``: under stage 3 a sharded parameter is
an empty placeholder outside forward, so the table said "Total params: 0". It also sizes the model
at 32 bits for every mixed precision (with a warning). :class:`ZeroSummary` counts every parameter
by its full shape (from the engine's :class:`~lightning_zero.zero.surface.HeldParam` records), adds
a "Params per Device" column (what this rank holds of each layer's parameters: all of them at stages
1 and 2 and for stage 3's small persistent ones, the shard otherwise) and sizes the model in its
compute dtype (bf16-mixed: 2 bytes a parameter, what the module holds; the fp32 masters and
optimizer states are sharded, see ``strategy.memory_breakdown()``).

:func:`install` points the trainer's ``ModelSummary`` / ``RichModelSummary`` callbacks at it (their
table format is kept); the strategy calls it at setup.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_zero.zero import HeldParam


class ZeroLayerSummary(LayerSummary):
    """One layer's row, parameters counted by their full size."""

    def __init__(self, module: nn.Module, full: Mapping[int, int]) -> None:
        super().__init__(module)
        self._full = full

    @property
    def num_parameters(self) -> int:
        return sum(self._full.get(id(p), p.numel()) for p in self._module.parameters())


class ZeroSummary(ModelSummary):
    """:class:`ModelSummary` counting sharded parameters by their full size; see the module docstring.

    Args:
        model: the LightningModule.
        max_depth: as for Lightning's summary.
        held: the engine's parameters (``engine.held_params()``).
        local: per parameter id, the elements this rank holds (its shard under stage 3).
        dtype: the compute dtype of the parameters (the model size is counted in it).
    """

    def __init__(
        self,
        model: Any,
        max_depth: int,
        held: list[HeldParam],
        local: Mapping[int, int],
        dtype: torch.dtype,
    ) -> None:
        self._full = {id(h.param): math.prod(h.shape) for h in held}
        self._local = dict(local)
        # Lightning's __init__ without its "precision not supported" warning: the size is exact here.
        self._model = model
        if not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"`max_depth` can be -1, 0 or > 0, got {max_depth}.")
        self._flop_counter = FlopCounterMode(display=False, depth=max_depth + 1)
        self._max_depth = max_depth
        self._layer_summary = self.summarize()
        self._precision_megabytes = torch.finfo(dtype).bits / 8.0 * 1e-6

    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, LayerSummary] = OrderedDict(
            (name, ZeroLayerSummary(module, self._full)) for name, module in self.named_modules
        )
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for key in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[key]
        return summary

    def _count(self, p: nn.Parameter) -> int:
        return self._full.get(id(p), p.numel())

    @property
    def total_parameters(self) -> int:
        return sum(self._count(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(self._count(p) for p in self._model.parameters() if p.requires_grad)

    @property
    def parameters_per_rank(self) -> list[int]:
        return [self._layer_local(layer) for layer in self._layer_summary.values()]

    def _layer_local(self, layer: LayerSummary) -> int:
        return sum(self._local.get(id(p), p.numel()) for p in layer._module.parameters())

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

        arrays = super()._get_summary_data()
        # the name of DeepSpeedSummary's column, which RichModelSummary lays out after "Params"
        column = ("Params per Device", [get_human_readable_count(n) for n in self.parameters_per_rank])
        position = next((i + 1 for i, (name, _) in enumerate(arrays) if name == "Params"), len(arrays))
        arrays.insert(position, column)
        return arrays


def local_counts(held: list[HeldParam]) -> dict[int, int]:
    """Per parameter id, the elements this rank holds: the whole parameter where it is materialized
    (stages 1/2, stage 3's persistent ones), else its piece of the shard."""
    out = {}
    for h in held:
        whole = h.param.numel() == math.prod(h.shape)
        out[id(h.param)] = h.param.numel() if whole else (h.local[2] if h.local is not None else 0)
    return out


def install(trainer: Any, held: list[HeldParam], dtype: torch.dtype) -> None:
    """Make the trainer's summary callbacks build a :class:`ZeroSummary` (an instance attribute on
    each callback object of this trainer; their table format and depth are kept). What is installed
    is a :class:`SummaryFactory`, not a local closure: the trainer and its callbacks still pickle."""
    local = local_counts(held)
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummaryCallback):
            factory = SummaryFactory(callback._max_depth, held, local, dtype)
            callback._summary = factory  # type: ignore[method-assign,assignment]  # this trainer's callbacks only


class SummaryFactory:
    """What :func:`install` puts in place of ``ModelSummary._summary``: builds a :class:`ZeroSummary`."""

    def __init__(self, depth: int, held: list[HeldParam], local: Mapping[int, int], dtype: torch.dtype) -> None:
        self.depth = depth
        self.held = held
        self.local = dict(local)
        self.dtype = dtype

    def __call__(self, _trainer: Any, pl_module: Any) -> ZeroSummary:
        return ZeroSummary(pl_module, self.depth, self.held, self.local, self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        # ``local`` is keyed by id(param), meaningless in another process: a pickled copy (a trainer
        # saved with torch.save) sizes what it is given by the parameters' own sizes
        return {"depth": self.depth, "held": [], "local": {}, "dtype": self.dtype}
