"""Pretrained weights into a model, tensor by tensor, so that a sharded model never holds them whole.

    def configure_model(self):
        if self.model is None:
            self.model = GPT2LMHeadModel(config)
            lightning_zero.load_pretrained(self.model, "path/to/hf_dir")

``path`` is a safetensors file, a torch state-dict file (``torch.load(weights_only=True)``, read
memory-mapped; a Lightning checkpoint's ``state_dict`` too), or a directory as ``save_pretrained``
writes it (``model.safetensors``, or shards listed in ``model.safetensors.index.json``; else
``pytorch_model.bin`` and its index). Keys are the module's ``state_dict()`` keys; of tied
parameters (one Parameter under several names) one name is enough.

Under stage 3, inside ``configure_model``, the model is being recorded on the meta device
(:mod:`lightning_zero.zero.deferred`): each load is recorded as one op that overwrites its tensor,
and the build reads each tensor from the file when it replays that tensor into this rank's shard,
so a rank's peak is its shards plus the largest tensor. Elsewhere (stages 1 and 2, or a model built
unsharded) the values are copied in at once, one tensor at a time. Dtypes are cast to the model's
(as ``from_pretrained`` does). Missing, unexpected and wrong-shape keys raise one ValueError listing
them, before anything is loaded; ``strict=False`` loads what matches and returns the lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from lightning_zero.zero import Recording, active_recording


@dataclass
class LoadResult:
    """What ``load_pretrained`` did not load (empty lists when everything matched)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "key: file (shape) vs model (shape)"


class _Source:
    """Keys, shapes and one tensor at a time of a weights file or a ``save_pretrained`` directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, Path] = {}  # key -> file (safetensors)
        self._state: dict[str, torch.Tensor] | None = None  # torch files, memory-mapped
        if self.path.is_dir():
            self._open_dir()
        elif self.path.suffix == ".safetensors":
            self._index_safetensors([self.path])
        elif self.path.is_file():
            self._open_torch([self.path])
        else:
            raise ValueError(f"load_pretrained: {self.path} does not exist")

    def _open_dir(self) -> None:
        for index_name, opener in (
            ("model.safetensors.index.json", self._index_safetensors),
            ("pytorch_model.bin.index.json", self._open_torch),
        ):
            index = self.path / index_name
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
                opener(sorted({self.path / name for name in weight_map.values()}))
                return
        for name, opener in (("model.safetensors", self._index_safetensors), ("pytorch_model.bin", self._open_torch)):
            if (self.path / name).exists():
                opener([self.path / name])
                return
        raise ValueError(
            f"load_pretrained: {self.path} holds none of model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin or pytorch_model.bin.index.json; pass the weights file itself."
        )

    def _index_safetensors(self, files: list[Path]) -> None:
        safe_open = _safe_open()
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                self._files.update({key: file for key in f.keys()})  # noqa: SIM118 (not a dict)

    def _open_torch(self, files: list[Path]) -> None:
        self._state = {}
        for file in files:
            loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
                loaded = loaded["state_dict"]  # a Lightning checkpoint
            if not isinstance(loaded, dict):
                raise ValueError(f"load_pretrained: {file} holds a {type(loaded).__name__}, not a state dict")
            self._state.update({k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)})

    def keys(self) -> list[str]:
        return list(self._state) if self._state is not None else list(self._files)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._state is not None:
            return tuple(self._state[key].shape)
        with _safe_open()(str(self._files[key]), framework="pt", device="cpu") as f:
            return tuple(f.get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        if self._state is not None:
            return self._state[key]
        with _safe_open()(str(self._files[key]), framework="pt", device="cpu") as f:
            return f.get_tensor(key)


def _safe_open() -> Callable[..., Any]:
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError(
            "reading .safetensors needs the safetensors package: pip install safetensors (transformers installs it)"
        ) from error
    return safe_open


#: ``mapping(model_key)``: the file keys that make up one model tensor and how to combine them (e.g.
#: HF's separate query/key/value into one fused projection, a Conv1D transposed); ``None``: the file
#: has nothing for this key. Default: the same key, unchanged.
Mapping = Callable[[str], "tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None"]


def _same(key: str) -> tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]]:
    return [key], _first


def _first(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _load_into(
    target: torch.Tensor, source: _Source, keys: list[str], combine: Callable[[list[torch.Tensor]], torch.Tensor]
) -> None:
    with torch.no_grad():
        target.copy_(combine([source.read(key) for key in keys]))


def load_pretrained(
    module: nn.Module, path: str | Path, strict: bool = True, mapping: Mapping | None = None
) -> LoadResult:
    """Load the weights at ``path`` into ``module``'s parameters and persistent buffers; see the
    module docstring. ``mapping`` translates another model's checkpoint (``recipes/common/from_hf.py``
    maps HF GPT-2 and BERT onto the recipes' models). Returns what was not loaded (only non-empty
    with ``strict=False``)."""
    recording = active_recording()
    with _disable_current_modes():  # reading the file creates real tensors, even while recording
        return _load_pretrained(module, _Source(path), strict, str(path), recording, mapping or _same)


def _load_pretrained(
    module: nn.Module, source: _Source, strict: bool, path: str, recording: Recording | None, mapping: Mapping
) -> LoadResult:
    saved = set(source.keys())
    names = module.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}  # tensor -> its names (tied parameters have several)
    for name, tensor in names.items():
        groups.setdefault(id(tensor), []).append(name)
    result, plan, used = LoadResult(), [], set()
    for aliases in groups.values():
        found = [(n, m) for n in aliases if (m := mapping(n)) is not None and all(k in saved for k in m[0])]
        if not found:
            result.missing.extend(aliases)
            continue
        name, (keys, combine) = found[0]
        used.update(keys)
        tensor = names[name]
        # the combined shape, from meta tensors of the saved shapes (no data read)
        shape = tuple(combine([torch.empty(source.shape(k), device="meta") for k in keys]).shape)
        if shape != tuple(tensor.shape):
            result.mismatched.append(f"{name}: file {shape} vs model {tuple(tensor.shape)}")
            continue
        plan.append((tensor, name, keys, combine))
    result.unexpected = sorted(saved - used - {k for n in names for k in (mapping(n) or ([], None))[0]})
    problems = [(what, keys) for what, keys in vars(result).items() if keys]
    if strict and problems:
        listed = "; ".join(
            f"{len(keys)} {what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}" for what, keys in problems
        )
        raise ValueError(
            f"load_pretrained({path}): the file does not match the model's state_dict keys: {listed}. Fix the "
            "model's configuration (or the mapping), or pass strict=False to load the keys that match."
        )
    for tensor, name, keys, combine in plan:
        if recording is not None and recording.recorded(tensor):
            recording.record_call(_load_into, tensor, (source, keys, combine), {}, draws=False)
        elif tensor.is_meta:
            raise ValueError(
                f"load_pretrained: {name} is on the meta device outside a stage-3 configure_model; build the "
                "model for real (or inside configure_model under stage 3) before loading into it."
            )
        else:
            _load_into(tensor, source, keys, combine)
    return result
