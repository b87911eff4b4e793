"""Step 2 of the data path for stage 3, **gather**: module hooks that bring sharded parameters in
just before they are used and let them go right after.

* Before a module's forward, the sharded flat buffers of its own parameters (tied ones included:
  ``head.weight is embed.weight`` makes the LM head gather the embedding's buffer) are all-gathered,
  and for a *gather unit* (:mod:`~lightning_zero.zero.units`: HF blocks, ``nn.MultiheadAttention``,
  RNNs, LoRA layers, ``gather_units``) those of its whole subtree; after its forward they are
  released, unless another module still holds them (reference counts, for nesting and for modules
  called several times) or the recorded order shows they are needed again within the prefetch
  window ("reused soon").
* A gradient hook on the module's outputs (``register_multi_grad_hook``, fired by the first of their
  gradients) gathers the buffers again before the gradients reach the module's own operations. (An
  identity autograd Function would do the same but would forbid in-place ops on the outputs.)
* After backward the gradient hooks of :mod:`~lightning_zero.zero.reduce` release a buffer as soon as
  all of its gradients arrived; :meth:`GatherCoordinator.end_pass` releases whatever is left.
* The order in which modules run is traced every step. The next step prefetches along the previous
  step's trace, up to ``prefetch_bucket_size`` elements ahead and ``max_live_parameters`` gathered
  in all; when a step deviates (a different branch, a shorter sequence), prefetching stops for the
  rest of that step and the new trace replaces the old one. Nothing crashes on an order change.
  (The window and the prefetches' deferred order check: :mod:`~lightning_zero.zero.gather_prefetch`.)

* Reading a released parameter elsewhere: modules holding sharded parameters get a subclass of their
  own class whose ``__getattr__`` asks the coordinator. Inside a running forward or a step (the
  Trainer's steps, Fabric's root forward) the parameter is gathered on use and kept until the end of
  the pass, and the module whose ``forward`` read it gathers it with its own from the next pass on;
  in a step, a :class:`~lightning_zero.zero.released.GatherOnUse` mode also gathers parameters that
  reach an op without an attribute read (``self.parameters()``). Elsewhere the read gives a
  :class:`~lightning_zero.zero.released.ReleasedParameter`: the full metadata, no data, and the
  error naming the parameter on any use of its values, instead of silently computing on this rank's
  piece (a released parameter is a view of its piece in the shard, so that elementwise in-place
  edits over ``module.parameters()`` land in the shards). ``ZeroStrategy.gathered_parameters``
  makes such reads legal. (That subclass, and the flags for checkpointing and recompute:
  :mod:`~lightning_zero.zero.guarded`.)

All ranks must run the same modules in the same order (the all-gathers are collectives). On a gloo
group each gather is preceded by an exchange of the buffer's number
(:class:`~lightning_zero.debug.GatherOrderCheck`), so a branch taken by one rank only is an error
naming what each rank was about to gather; elsewhere ``ZeroStrategy(debug_collectives=True)`` does
the same for every collective (the gathers are labelled with the module's qualified name for it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from lightning_zero import comm
from lightning_zero.config import ZeroConfig
from lightning_zero.debug import GatherOrderCheck, PendingCheck
from lightning_zero.zero.flat import FlatBuffer, ParamState
from lightning_zero.zero.gather_prefetch import GatherPrefetch
from lightning_zero.zero.guarded import RECOMPUTING, guarded_class
from lightning_zero.zero.released import GatherOnUse, ReleasedParameter
from lightning_zero.zero.units import gather_units

if TYPE_CHECKING:
    from lightning_zero.zero.swap import ParamTier


class GatherCoordinator(GatherPrefetch):
    """Owns the forward hooks of every module that uses sharded parameters."""

    def __init__(
        self,
        module: nn.Module,
        buffers: list[FlatBuffer],
        config: ZeroConfig,
        group: comm.ProcessGroup,
        shard_tier: ParamTier | None = None,
    ) -> None:
        self.config = config
        self.group = group
        #: the parameter disk tier: its reads are started along the plan ahead of the gathers
        self.shard_tier = shard_tier
        owner = {id(p): b for b in buffers if not b.persistent for p in b.params}
        self._owner = owner
        shapes = {
            id(p): slot.shape
            for b in buffers
            if not b.persistent
            for p, slot in zip(b.params, b.layout.slots, strict=True)
        }
        #: id -> (qualified name, full shape) of every sharded parameter
        self._params = {
            id(p): (n, shapes[id(p)]) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in owner
        }
        self._all: list[FlatBuffer] = []
        for b in buffers:
            if not b.persistent and all(b is not o for o in self._all):
                self._all.append(b)
        self._number = {id(b): i for i, b in enumerate(self._all)}
        self._order = (
            GatherOrderCheck(comm.side_gloo_group(group), self._describe) if comm.is_plain_gloo(group) else None
        )
        #: prefetches decided at the last hook, their order check in flight: they start at the next one
        self._pending: tuple[PendingCheck, list[FlatBuffer], str] | None = None

        def sharded(params: Any) -> list[FlatBuffer]:
            found: list[FlatBuffer] = []
            for param in params:
                b = owner.get(id(param)) if param is not None else None
                if b is not None and all(b is not other for other in found):
                    found.append(b)
            return found

        units = gather_units(module, config.gather_units)
        self._guarded: list[tuple[nn.Module, type]] = []
        self.modules: list[nn.Module] = []
        self.names: list[str] = []  # qualified module names, for the collective checker's messages
        #: per module: the buffers its hooks gather (its own parameters'; a unit's: its subtree's)
        self.needs: list[list[FlatBuffer]] = []
        self._handles: list[Any] = []
        self._index_of: dict[int, int] = {}
        #: every module with sharded parameters below it: a forward that may read them (learned needs)
        self._qualnames: dict[int, tuple[str, nn.Module]] = {}
        for qualname, sub in module.named_modules():
            if not sharded(sub.parameters()):
                continue
            self._qualnames[id(sub)] = (qualname, sub)
            own = sharded(sub._parameters.values())
            if own:
                self._guarded.append((sub, type(sub)))
                sub.__class__ = guarded_class(type(sub))
                sub._lightning_zero_coordinator = self
            if id(sub) in units:
                self._track(sub, sharded(sub.parameters()))
            elif own:
                self._track(sub, own)
        #: the root unit: what the root module itself holds, gathered around each step
        self.root_needs = sharded(module._parameters.values())
        self._root = module
        self._refs: dict[int, int] = {}
        self._pinned: set[int] = set()
        self.trace: list[int] = []  # module indices in the order they ran this step
        self.previous: list[int] = []  # last step's trace: the prefetch plan
        self._on_plan = True
        self._bwd_cursor = -1
        self._running: list[int] = []  # modules whose forward is running, innermost last
        #: id(module) -> buffers its forward read (gathered on use): they join its needs at the pass's end
        self._learned: dict[int, list[FlatBuffer]] = {}
        self._depth = 0  # nesting of open steps
        self._mode: GatherOnUse | None = None
        #: the Trainer's :class:`~lightning_zero.lockstep.StepLockstep`: told of each step and of each
        #: forward outside the steps that gathers (one some ranks may run alone)
        self.lockstep: Any = None

    def _describe(self, number: int) -> str:
        if not 0 <= number < len(self._all):
            return f"buffer #{number}"
        names = [self._params[id(p)][0] for p in self._all[number].params if id(p) in self._params]
        return "the parameters " + ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")

    def _start(self, buffers: list[FlatBuffer], label: str) -> None:
        """Start the gathers of those of ``buffers`` that are released, first checking (one exchange
        for all of them, waited for) that every rank is about to gather the same ones."""
        self._flush()
        released = [b for b in buffers if b.state is ParamState.RELEASED]
        if not released:
            return
        if self._order is not None:
            self._order.agree([self._number[id(b)] for b in released], label)
        for b in released:
            b.gather_start(self.group, label)

    def _track(self, sub: nn.Module, needs: list[FlatBuffer]) -> None:
        """Give ``sub`` the hooks that gather ``needs`` around its forward and before its backward."""
        index = len(self.modules)
        self._index_of[id(sub)] = index
        self.modules.append(sub)
        qualname = self._qualnames[id(sub)][0]
        self.names.append(repr(qualname) if qualname else "the root module")
        self.needs.append(needs)
        # Under torch.compile the hooks run eagerly, as graph breaks: they swap ``param.data`` and
        # issue collectives, which a traced graph would bake in (docs/activation-checkpointing.md, "torch.compile").
        pre, post = self._make_pre_forward(index), self._make_post_forward(index)
        # prepend: before the module's own pre-hooks, which may read its parameters (the old
        # hook-based torch.nn.utils.spectral_norm / weight_norm compute the weight from them there)
        self._handles.append(sub.register_forward_pre_hook(torch.compiler.disable(pre), prepend=True))
        self._handles.append(sub.register_forward_hook(torch.compiler.disable(post)))

    def _reader(self) -> nn.Module | None:
        """The innermost module of the model whose ``forward`` is on the Python stack (the one reading
        a parameter now). Walks the frames: only on a gather on use, never on the hot path, and it
        spares every container module a pair of hooks (and torch.compile a graph break each)."""
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "forward":
                candidate = frame.f_locals.get("self")
                if candidate is not None and id(candidate) in self._qualnames:
                    return candidate
            frame = frame.f_back
        return None

    # -- reads of released parameters ------------------------------------------------------------

    def is_released(self, value: Any) -> bool:
        """``value`` is a sharded parameter whose full data is not here right now (its buffer is
        released or still gathering; the same answer on every rank)."""
        b = self._owner.get(id(value))
        return b is not None and b.state is not ParamState.GATHERED

    def released_read(self, param: nn.Parameter) -> torch.Tensor:
        """A module attribute read of a released parameter: gathered on use inside a forward or a step
        (a collective: every rank reads it at the same point of the same code), a metadata-only
        :class:`ReleasedParameter` elsewhere."""
        if self._depth or self._running or RECOMPUTING.get():
            self.gather_on_use(param)
            return param
        name, shape = self._params[id(param)]
        return ReleasedParameter(param, shape, name)

    def gather_on_use(self, param: nn.Parameter) -> None:
        """Gather ``param``'s buffer now and keep it until the end of the pass (the backward may need
        it); a module whose forward read it gathers it with its own from the next pass on. Call on all ranks."""
        b = self._owner[id(param)]
        reader = self._reader()
        where = "the step" if reader is None else repr(self._qualnames[id(reader)][0] or "the root module")
        self.acquire([b], f"{self._params[id(param)][0]!r} read in {where}")
        self.pin([b])
        if reader is not None and not RECOMPUTING.get():
            learned = self._learned.setdefault(id(reader), [])
            if all(b is not o for o in learned):
                learned.append(b)

    def _open(self, *args: Any) -> None:
        """A step begins (or the root's forward): the root unit is gathered, and ops gather released
        parameters they are given (:class:`GatherOnUse`). Call on all ranks."""
        if self._depth == 0:
            if self.lockstep is not None:
                self.lockstep.before_step()
            self._running.clear()  # left over by a forward that raised
            self.acquire(self.root_needs, "the root module (step)")
            self.pin(self.root_needs)
            self._mode = GatherOnUse(self.is_released, self.gather_on_use)
            self._mode.__enter__()
        self._depth += 1

    def _close(self, *args: Any) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0 and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def step_on_root_forward(self) -> None:
        """Make the root module's forward a step (Fabric, where no step hook exists): its first
        pre-hook opens it and its last hook closes it, also when the forward raises. (The Trainer
        strategy opens its steps itself; root hooks there would only add two graph breaks per step
        under a compiled LightningModule.)"""
        root = self._root
        self._handles.append(root.register_forward_pre_hook(torch.compiler.disable(self._open), prepend=True))
        self._handles.append(root.register_forward_hook(torch.compiler.disable(self._close), always_call=True))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around a training/validation/test/predict step: every parameter may be read (see :meth:`_open`)."""
        self._open()
        try:
            yield
        finally:
            self._close()

    # -- reference-counted gather/release ----------------------------------------------------

    def acquire(self, buffers: list[FlatBuffer], label: str = "") -> None:
        """Gather ``buffers`` (waiting for any in flight) and hold them. Call on all ranks."""
        self._start(buffers, label)
        for b in buffers:
            b.gather_wait()
            self._refs[id(b)] = self._refs.get(id(b), 0) + 1

    def drop(self, buffers: list[FlatBuffer], keep: bool = False) -> None:
        """Let go of ``buffers``; one whose last holder left is released unless ``keep``."""
        for b in buffers:
            count = self._refs.get(id(b), 0) - 1
            self._refs[id(b)] = max(count, 0)
            if count <= 0 and not keep and id(b) not in self._pinned:
                b.release()

    def pin(self, buffers: list[FlatBuffer]) -> None:
        """Keep ``buffers`` gathered until the end of this forward/backward: tensors computed from
        them outside their modules (inside ``gathered_parameters``) need them again in backward, and
        no module hook would gather them then. Their gradient hooks still release them once all of
        their gradients have arrived, which happens after every use in backward."""
        self._pinned.update(id(b) for b in buffers)

    # -- forward -------------------------------------------------------------------------------

    def _make_pre_forward(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if RECOMPUTING.get():  # activation checkpointing, in backward: gather only
                # no reference taken: no post-forward drop follows
                self._start(self.needs[index], f"{self.names[index]} (recompute)")
                for b in self.needs[index]:
                    b.gather_wait()
                return
            outside = self.lockstep is not None and not self._depth and not self._running
            if outside and any(b.state is not ParamState.GATHERED for b in self.needs[index]):
                self.lockstep.before_unscoped(f"{self.names[index]} of {type(self._root).__name__}")
            self._running.append(index)
            position = len(self.trace)
            self.trace.append(index)
            if self._on_plan and (position >= len(self.previous) or self.previous[position] != index):
                self._on_plan = False  # the order changed: no prefetch until the next step
            self.acquire(self.needs[index], f"{self.names[index]} (forward)")
            if self._on_plan:
                self._read_ahead(self.previous[position + 1 :])
                self._prefetch(self.previous[position + 1 :])

        return hook

    def _make_post_forward(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if RECOMPUTING.get():
                # The backward consuming these activations runs next and needs the parameters; the
                # reduction's gradient hooks release them once their gradients arrived (or end_pass).
                return output
            if self._running and self._running[-1] == index:
                self._running.pop()
            self.drop(self.needs[index], keep=self._reused_soon(index))
            if not torch.is_grad_enabled():
                return output
            leaves, _ = tree_flatten(output)
            tensors = tuple(leaf for leaf in leaves if torch.is_tensor(leaf) and leaf.requires_grad)
            if tensors:
                register_multi_grad_hook(tensors, lambda grads: self.pre_backward(index), mode="any")
            return output

        return hook

    # -- backward ------------------------------------------------------------------------------

    def pre_backward(self, index: int) -> None:
        """Gather a module's parameters before its backward; prefetch the modules that ran before it."""
        self._start(self.needs[index], f"{self.names[index]} (backward)")
        for b in self.needs[index]:
            b.gather_wait()
        cursor = self._bwd_cursor if self._bwd_cursor >= 0 else len(self.trace)
        found = next((p for p in range(min(cursor, len(self.trace)) - 1, -1, -1) if self.trace[p] == index), None)
        if found is not None:
            self._bwd_cursor = found
            upcoming = self.trace[found - 1 :: -1] if found > 0 else []
            self._read_ahead(upcoming)
            self._prefetch(upcoming)

    # -- step boundaries -------------------------------------------------------------------------

    def end_pass(self) -> None:
        """End of one forward/backward pass: release everything still gathered and make this pass's
        trace the next pass's plan. Call on all ranks."""
        self._flush(start=False)  # prefetches past the pass's end: checked, never gathered
        for b in self._all:
            b.release()
        for module_id, learned in self._learned.items():
            if module_id not in self._index_of:
                self._track(self._qualnames[module_id][1], [])
            index = self._index_of[module_id]
            self.needs[index] += [b for b in learned if all(b is not o for o in self.needs[index])]
        self._learned.clear()
        self._running.clear()
        self._refs.clear()
        self._pinned.clear()
        if self.shard_tier is not None:
            self.shard_tier.end_pass()
        if self.trace:
            self.previous = self.trace
        self.trace = []
        self._on_plan = True
        self._bwd_cursor = -1

    def gathered_buffers(self, module: nn.Module) -> list[FlatBuffer]:
        """The sharded buffers holding parameters of ``module`` (recursively)."""
        ids = {id(p) for p in module.parameters()}
        return [b for b in self._all if any(id(p) in ids for p in b.params)]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._depth = 1
        self._close()
        for sub, cls in self._guarded:
            sub.__class__ = cls
            del sub._lightning_zero_coordinator
        self._guarded.clear()
