"""Stage 3's gather units: which modules gather their whole subtree before their forward.

A module's forward that reads a descendant's parameter without calling the descendant
(``T5DenseActDense`` reads ``self.wo.weight.dtype``, ``nn.MultiheadAttention`` hands
``self.out_proj.weight`` to the functional attention, PEFT's LoRA layer reads ``lora_A.weight``)
needs that parameter gathered before the descendant's own hook would gather it. A *unit* is a module
whose pre-forward hook gathers every sharded parameter of its subtree (FSDP2's ``fully_shard(block)``,
DeepSpeed's "leaf modules"); its descendants' own hooks then find their parameters gathered already.

The default policy makes these modules units, without the user's help:

* the classes a Hugging Face model names in ``_no_split_modules`` (its transformer blocks, which
  that library already declares as the smallest piece that must stay whole on one device),
* ``nn.MultiheadAttention`` and every RNN module (``nn.RNNBase``: GRU, LSTM, RNN),
* PEFT's LoRA layers (subclasses of ``peft.tuners.lora.LoraLayer``, matched by name so that peft
  need not be installed).

``ZeroConfig.gather_units`` adds classes, class names or module names (``fnmatch`` patterns of
qualified names, e.g. ``"model.layers.*"``). Modules a forward is *seen* reading a parameter of
(at run time) are handled by :mod:`~lightning_zero.zero.gather` without being units: the read
parameter joins that module's gather from the next step on.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

#: torch's own modules whose forward reads their children's parameters directly
_TORCH_UNITS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.RNNBase)
#: (module prefix, class name) of third-party base classes whose subclasses read children's parameters
_NAMED_BASES = (("peft.", "LoraLayer"),)


def _named_base(cls: type) -> bool:
    return any(
        base.__name__ == name and base.__module__.startswith(prefix)
        for base in cls.__mro__
        for prefix, name in _NAMED_BASES
    )


def _no_split_classes(module: nn.Module) -> set[str]:
    names: set[str] = set()
    for sub in module.modules():
        declared = getattr(type(sub), "_no_split_modules", None) or getattr(sub, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def _matches(entry: type | str, qualname: str, sub: nn.Module) -> bool:
    if isinstance(entry, type):
        return isinstance(sub, entry)
    return type(sub).__name__ == entry or fnmatch.fnmatchcase(qualname, entry)


def gather_units(module: nn.Module, extra: Iterable[type | str] = ()) -> set[int]:
    """``id`` of every module of ``module`` that is a gather unit: the default policy (module
    docstring) plus ``extra`` (classes, class names, qualified-name patterns).

    Raises:
        ValueError: an entry of ``extra`` matches no module of the model (a typo would otherwise
            silently leave the modules it meant ungathered).
    """
    extra = tuple(extra)
    hf_blocks = _no_split_classes(module)
    units: set[int] = set()
    used: set[int] = set()
    for qualname, sub in module.named_modules():
        hits = [i for i, entry in enumerate(extra) if _matches(entry, qualname, sub)]
        used.update(hits)
        cls = type(sub)
        if hits or isinstance(sub, _TORCH_UNITS) or _named_base(cls) or cls.__name__ in hf_blocks:
            units.add(id(sub))
    unused = [extra[i] for i in range(len(extra)) if i not in used]
    if unused:
        shown = [e.__name__ if isinstance(e, type) else e for e in unused]
        raise ValueError(
            f"gather_units={shown} match no module of the model ({type(module).__name__}). Give module classes, "
            "class names (e.g. 'LlamaDecoderLayer') or qualified module names as named_modules() prints them "
            "(fnmatch patterns such as 'model.layers.*')."
        )
    return units
