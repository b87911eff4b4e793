"""Sharded construction that starts from the unsharded model's exact weights: record, then replay.

Under stage 3, ``configure_model`` runs inside :class:`Recorder`: every tensor is created on the
meta device (no memory) and every aten op that touches a meta tensor is written down, with its
arguments, in order. Any way a model initializes itself is an op sequence, so this covers
``reset_parameters()``, init loops in ``__init__``, ``self.apply(fn)``, HF ``post_init()``, tied
weights (one Parameter object, so one storage), ``padding_idx`` rows, buffers computed in
``__init__`` (causal masks, rotary tables) and ``torch.empty`` filled later.

**The random stream.** The op that draws random numbers (``normal_``, ``uniform_``, ``randn``, ...:
the ops torch tags ``nondeterministic_seeded``) also runs for real when it is recorded, on the
device the model will live on, into a reused scratch tensor of the same view: the generator then
advances exactly as in an unsharded build, whatever runs in between (a reseed, a random op on a real
tensor), and the generator's state before the op is kept with it. After ``configure_model`` the
generator is where the unsharded build would have left it, so training draws the same dropout masks.

**Replay** (:meth:`Recording.materialize`, called by the stage-3 build one module at a time): the
ops that the final value of one storage depends on are found by a backward scan (an op counts when it
writes a storage still needed; it adds the storages it reads; an op that overwrites a whole storage
without reading it ends that storage's history) and run again, in their recorded order, on the
device, each random op from its saved generator state. The result is the tensor the unsharded build
computes, bit for bit: the same ops, in the same order, on the same device, from the same random
state. Only one storage's chain is whole at a time (plus the scratch of the largest random op), so
no rank ever holds the whole model: the caller keeps this rank's shard and frees the rest.

What cannot be recorded fails loudly in ``configure_model`` (an op that needs values of a meta
tensor, e.g. ``.item()``, raises there; a random op with an explicit ``generator=`` raises a
ValueError), and a parameter that nothing ever wrote is reported by :meth:`Recording.initialized`,
so the build never trains from uninitialized memory.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

_META = torch.device("meta")
# Factories that allocate without writing: a storage born from one of these holds garbage.
_EMPTY = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
# In-place ops that set every element of their first argument without reading it.
_OVERWRITE = {"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "exponential_", "cauchy_",
              "log_normal_", "geometric_"}  # fmt: skip


@dataclass(frozen=True)
class _Ref:
    """A meta tensor, as a view (``size``, ``stride``, ``offset`` in elements) of recorded storage ``key``."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Op:
    func: torch._ops.OpOverload
    args: Any  # the op's (args, kwargs) with every meta tensor replaced by its _Ref
    writes: frozenset[int]
    reads: frozenset[int]
    born: tuple[_Ref | None, ...]  # per output leaf: its _Ref when the op created its storage
    overwrites: frozenset[int] = frozenset()
    rng_state: torch.Tensor | None = None  # the generator before the op, for random ops


@dataclass
class Recording:
    """The ops of one ``configure_model`` under :class:`Recorder`; see the module docstring."""

    device: torch.device
    #: built under ``init_module(empty_init=True)``: a tensor nothing wrote may stay uninitialized
    empty_init: bool = False
    ops: list[_Op] = field(default_factory=list)
    # Keeps storages (and so their keys) alive. The storage, not the tensor: a tensor would keep its
    # autograd graph alive too, and with it references to the parameters it was computed from
    # (register_parametrization evaluates the parametrization once), which torch.utils.swap_tensors
    # refuses when the build materializes them.
    _keep: list[torch.UntypedStorage] = field(default_factory=list)
    _nbytes: dict[int, int] = field(default_factory=dict)  # key -> storage bytes
    _written: set[int] = field(default_factory=set)  # storages some op put values into
    _scratch: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    # ---- recording -------------------------------------------------------------------------
    def _key(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._nbytes:
            self._nbytes[key] = storage.nbytes()
            self._keep.append(storage)
        return key

    def _ref(self, t: torch.Tensor) -> _Ref:
        return _Ref(self._key(t), t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _covers(self, t: torch.Tensor) -> bool:
        """True when ``t`` is every byte of its storage (an overwrite of it ends the storage's history)."""
        return (
            t.storage_offset() == 0
            and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        )

    def record(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        known = set(self._nbytes)
        mutated: list[torch.Tensor] = []
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            mutated.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_meta)
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        born = tuple(self._ref(t) if t.is_meta and t.untyped_storage()._cdata not in known else None for t in outputs)
        name = func._schema.name.split("::")[-1]
        overwrites = frozenset(self._key(t) for t in mutated if name in _OVERWRITE and self._covers(t))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_meta]
        # the overwritten argument itself is not read; anything else (a copy's source) is
        reads = frozenset(
            self._key(t) for t in inputs if self._key(t) not in overwrites or not any(t is m for m in mutated)
        )
        foreign = [t for t in inputs if t.untyped_storage()._cdata not in known]
        if foreign:
            raise ValueError(
                f"{func} reads a meta tensor of shape {tuple(foreign[0].shape)} that was not created while the model "
                "was being built; under stage 3 create every tensor inside configure_model (or build in __init__)."
            )
        writes = frozenset({self._key(t) for t in mutated} | {r.key for r in born if r is not None})
        if name not in _EMPTY:
            self._written.update(writes)
        recorded = tree_map(lambda x: self._ref(x) if isinstance(x, torch.Tensor) and x.is_meta else x, (args, kwargs))
        op = _Op(func, recorded, writes, reads, born, overwrites)
        if torch.Tag.nondeterministic_seeded in func.tags:
            op.rng_state = self._draw(func, op)
        self.ops.append(op)

    def _draw(self, func: torch._ops.OpOverload, op: _Op) -> torch.Tensor:
        """Run a random op for real into scratch (the generator advances as in an unsharded build);
        returns the generator's state before it."""
        args, kwargs = op.args
        if kwargs.get("generator") is not None:
            raise ValueError(
                f"{func} with an explicit generator= while building the model under stage 3: the sharded build "
                "replays random ops from the default generator only. Drop generator=, or build the model in "
                "__init__ (unsharded) instead of configure_model."
            )
        state = _generator(self.device).get_state()
        func(*tree_map(self._scratch_view, args), **tree_map(self._scratch_view, kwargs))
        return state

    def _scratch_view(self, x: Any) -> Any:
        if isinstance(x, torch.device) and x == _META:
            return self.device
        if not isinstance(x, _Ref):
            return x
        extent = x.offset + sum((n - 1) * s for n, s in zip(x.size, x.stride, strict=True)) + 1 if all(x.size) else 0
        have = self._scratch.get(x.dtype)
        if have is None or have.numel() < extent:
            have = self._scratch[x.dtype] = torch.zeros(max(extent, 1), dtype=x.dtype, device=self.device)
        return have.as_strided(x.size, x.stride, x.offset)

    def record_call(
        self, fn: Any, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], draws: bool = True
    ) -> None:
        """Record ``fn(tensor, *args, **kwargs)``, a Python function that writes ``tensor`` (a
        torch.nn.init function that skips meta tensors, see :class:`Recorder`; a pretrained load), as
        one op. With ``draws`` it may draw random numbers: it runs for real into scratch now, like a
        random op, and replays from the generator state it found."""
        if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
            raise ValueError(
                f"{fn.__name__}(generator=...) while building the model under stage 3: the sharded build replays "
                "random ops from the default generator only. Drop the generator, or build the model in __init__."
            )
        key, ref = self._key(tensor), self._ref(tensor)
        whole = self._covers(tensor)
        op = _Op(fn, ((ref, *args), kwargs), frozenset({key}), frozenset() if whole else frozenset({key}), ())
        op.overwrites = frozenset({key}) if whole else frozenset()
        self._written.add(key)
        if draws:
            op.rng_state = _generator(self.device).get_state()
            with _disable_current_modes(), torch.device(self.device):
                fn(self._scratch_view(ref), *args, **kwargs)
        self.ops.append(op)

    def by_value(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception) -> Any:
        """An op that meta tensors cannot run (``.item()``, ``bool()``, ``nonzero``: it needs values):
        run it on the replayed values of its meta arguments. A tensor result comes back as a meta
        tensor of the same shape, recorded (replay recomputes it); anything else as it is."""

        def value(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and self.recorded(x):
                return self.materialize(x)
            return self.device if isinstance(x, torch.device) and x == _META else x

        try:
            result = func(*tree_map(value, args), **tree_map(value, kwargs))
        except Exception:
            raise error from None
        leaves = tree_flatten(result)[0]
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            return result
        out = tree_map(
            lambda t: (
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
                if isinstance(t, torch.Tensor)
                else t
            ),
            result,
        )
        self.record(func, args, kwargs, out)
        return out

    def finish(self) -> None:
        """End of recording: the scratch is freed (replay needs none)."""
        self._scratch.clear()

    # ---- replay ----------------------------------------------------------------------------
    def recorded(self, t: torch.Tensor) -> bool:
        """True when ``t`` (a meta tensor) was created while recording."""
        return t.is_meta and t.untyped_storage()._cdata in self._nbytes

    def initialized(self, t: torch.Tensor) -> bool:
        """True when some recorded op put values into ``t``'s storage (not just allocated it)."""
        return t.untyped_storage()._cdata in self._written

    def _chain(self, key: int) -> Iterator[_Op]:
        """The ops that ``key``'s final value depends on, in recorded order. ``live``: storages whose
        values are needed; ``alloc``: storages only written into (their birth op is needed, not
        their earlier values)."""
        live, alloc, needed = {key}, set[int](), list[_Op]()
        for op in reversed(self.ops):
            born = {r.key for r in op.born if r is not None}
            if not (op.writes & live or born & alloc):
                continue
            needed.append(op)
            over = op.overwrites & live
            live -= born | over
            alloc = (alloc - born) | over | (op.writes - born - live)
            live |= op.reads
        return reversed(needed)

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """The real tensor (on the recording's device) that the unsharded build gives for meta tensor
        ``t``: its storage's chain of ops, replayed. The default generator is left as it was."""
        key = t.untyped_storage()._cdata
        generator = _generator(self.device)
        saved = generator.get_state()
        # Off the recorder and the meta default device (replay may run while recording, for by_value).
        with _disable_current_modes(), torch.device(self.device):
            return self._replay(key, t, generator, saved)

    def _replay(self, key: int, t: torch.Tensor, generator: torch.Generator, saved: torch.Tensor) -> torch.Tensor:
        bases: dict[int, torch.Tensor] = {}

        def real(x: Any) -> Any:
            if isinstance(x, torch.device) and x == _META:
                return self.device
            if not isinstance(x, _Ref):
                return x
            return bases[x.key].as_strided(x.size, x.stride, x.offset)

        try:
            for op in self._chain(key):
                if op.rng_state is not None:
                    generator.set_state(op.rng_state)
                args, kwargs = tree_map(real, op.args)
                result = op.func(*args, **kwargs)
                if not op.born:
                    continue
                out = [o for o in tree_flatten(result)[0] if isinstance(o, torch.Tensor)]
                for ref, value in zip(op.born, out, strict=True):
                    if ref is not None:
                        base = torch.empty(0, dtype=ref.dtype, device=value.device)
                        numel = value.untyped_storage().nbytes() // value.element_size()
                        bases[ref.key] = base.set_(value.untyped_storage(), 0, (numel,), (1,))
        finally:
            generator.set_state(saved)
        return bases[key].as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def close(self) -> None:
        """Drop everything recorded (after the build has materialized what it needs)."""
        self.ops.clear()
        self._keep.clear()
        self._scratch.clear()


def active_recording() -> Recording | None:
    """The recording of the :class:`Recorder` this code runs under (``configure_model`` under stage
    3), or ``None``."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, Recorder):
            return mode.recording
    return None


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if device.type != "cpu":
        raise ValueError(f"sharded construction replays random ops on cpu or cuda; the model's device is {device}")
    return torch.default_generator


# torch.nn.init functions that return at once on a meta tensor (they need values: rejection sampling,
# QR, index writes). While recording they are replaced by a wrapper that records the call as one op;
# trunc_normal_ through its helper, so that references taken at import time are covered too.
_SKIP_META = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")


class Recorder(TorchDispatchMode):
    """``with Recorder(device) as recording:`` builds on the meta device and records; see the module
    docstring. ``device`` is where the model will live (random ops are drawn there)."""

    def __init__(self, device: torch.device, skip_init: bool = False) -> None:
        super().__init__()
        self.recording = Recording(torch.device(device))
        self._patched: list[tuple[Any, str, Any]] = []  # (namespace, key, original)
        #: ``init_module(empty_init=True)``: torch.nn.init calls do nothing, as under Fabric's ``_EmptyInit``
        self.skip_init = skip_init
        self.recording.empty_init = skip_init

    def __enter__(self) -> Recording:  # yields the recording, not the mode
        self._patch()
        super().__enter__()
        return self.recording

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for namespace, key, original in reversed(self._patched):
                if isinstance(namespace, dict):
                    namespace[key] = original
                else:
                    setattr(namespace, key, original)
            self._patched.clear()
            self.recording.finish()

    def _patch(self) -> None:
        originals = {name: getattr(torch.nn.init, name) for name in _SKIP_META}
        for name, original in originals.items():
            self._patched.append((torch.nn.init, name, original))
            setattr(torch.nn.init, name, self._wrap(original))
        # transformers keeps its own references to torch's init functions (taken at import).
        hf = sys.modules.get("transformers.initialization")
        table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
        if isinstance(table, dict):
            for key, fn in list(table.items()):
                if fn in originals.values():
                    self._patched.append((table, key, fn))
                    table[key] = self._wrap(fn)

    def _wrap(self, original: Any) -> Any:
        recording = self.recording

        @functools.wraps(original)
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and recording.recorded(tensor):
                if not self.skip_init:
                    recording.record_call(original, tensor, args, kwargs)
                return tensor
            return original(tensor, *args, **kwargs)

        return wrapper

    def _factory_here(self, func: Any, leaves: list[Any], kwargs: dict[str, Any]) -> bool:
        """A tensor factory (no tensor inputs) for the model's device (or the default one)."""
        if any(isinstance(t, torch.Tensor) for t in leaves):
            return False
        if not any(a.name == "device" for a in func._schema.arguments):
            return False
        device = kwargs.get("device")
        if device is None:
            return True
        device, mine = torch.device(device), self.recording.device
        return device.type == "meta" or (device.type == mine.type and device.index in (None, mine.index))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        if self._factory_here(func, leaves, kwargs):
            # Created on meta; a tensor without elements is created for real (it costs nothing, and
            # code such as transformers' `torch.tensor([]).device` asks it which device it builds on).
            meta_kwargs = {**kwargs, "device": _META}
            out = func(*args, **meta_kwargs)
            if all(t.numel() == 0 for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
                return func(*args, **kwargs)
            self.recording.record(func, args, meta_kwargs, out)
            return out
        on_meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves)
        try:
            out = func(*args, **kwargs)
        except Exception as error:  # re-raised unless values make the op possible
            if not on_meta:
                raise
            return self.recording.by_value(func, args, kwargs, error)
        if on_meta or any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(out)[0]):
            self.recording.record(func, args, kwargs, out)
        return out


class Continuation(Recorder):
    """What a program does to a model built under :class:`Recorder` after that block and before the
    sharded build: Fabric's ``init_module(empty_init=True)``, then ``reset_parameters()`` or an init
    loop on the meta model, then ``setup`` (LitGPT's pretraining, FSDP programs). Ops on the
    recorded meta tensors, and tensors created on the meta device, go on into the same recording, so
    the build replays them too; everything else runs as usual (tensors made for the model's device
    stay real). Entered by :meth:`start`, left by :meth:`end` (the build) on all ranks."""

    def __init__(self, recording: Recording) -> None:
        super().__init__(recording.device)
        self.recording = recording

    def _factory_here(self, func: Any, leaves: list[Any], kwargs: dict[str, Any]) -> bool:
        device = kwargs.get("device")
        no_inputs = not any(isinstance(t, torch.Tensor) for t in leaves)
        return no_inputs and device is not None and torch.device(device).type == "meta"

    def start(self) -> Continuation:
        """Record from now on."""
        self.__enter__()
        return self

    def end(self) -> None:
        """Stop recording (a no-op when already stopped). ``ValueError`` when another dispatch mode
        entered since is still active (modes leave in the reverse order of entering)."""
        stack = _get_current_dispatch_mode_stack()
        if all(mode is not self for mode in stack):
            return
        if stack[-1] is not self:
            raise ValueError(
                f"{type(stack[-1]).__name__}, a TorchDispatchMode entered after fabric.init_module(), is still active "
                "when the model is set up: leave it before fabric.setup (the stage-3 build records what runs on "
                "the model between init_module and setup)."
            )
        self.__exit__(None, None, None)
