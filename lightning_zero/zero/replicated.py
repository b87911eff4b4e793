"""Step 4 for whole-model optimizers: replicated on every rank over full parameters, as under DDP.

LBFGS builds one flat vector of every parameter and gradient of its group, takes dot products over
all of it (its two-loop recursion, the curvature condition, the line search), and its ``step``
re-evaluates the closure (forward and backward) several times, moving the parameters between
evaluations. Neither flat slices (:mod:`~lightning_zero.zero.step`) nor one owner per tensor
(:mod:`~lightning_zero.zero.whole`) can step that: every rank would see a partial dot product. An
optimizer declared whole-model (``torch.optim.LBFGS``, or ``whole_model = True`` on the class, the
instance) runs instead on every rank over full fp32 parameters with full averaged gradients, as DDP
runs it: its states are **not** sharded (LBFGS: ``2 * history_size + 3`` vectors of the whole model
per rank). Its parameters stay in the flat buffers, so forward, the gradient reduction (buckets,
stage 2's reduce-scatter, the host tier), clipping by the global norm, the overflow check and the
checkpoints of the weights are those of every other parameter; only the step differs:

1. at the start of the user's ``step`` the full masters are assembled (at 32-true the parameters
   themselves are the fp32 masters: used in place, or copied to the host when the optimizer is
   offloaded; under bf16-mixed an all-gather of the fp32 master slices) and become the optimizer's
   parameters, one tensor (**key**) per parameter;
2. each closure evaluation writes the keys into the model's parameters, runs the user's closure,
   completes the reduction, runs the user's ``on_before_optimizer_step`` and clipping, and
   all-gathers the reduced slices into the keys' ``.grad`` (DDP's averaged ``param.grad``); the loss
   it returns to the optimizer is averaged over the ranks too (one scalar all-reduce), the loss whose
   gradient the keys hold. Under DDP each rank's LBFGS reads its own batch's loss, so the ranks' line
   searches may accept different steps, or evaluate the closure a different number of times and
   leave DDP's all-reduce waiting forever; here every rank takes the same decisions;
3. after the class's ``step`` every rank holds the same updated keys (the same arithmetic on the
   same values): they are written into the parameters and this rank's master slice without
   communication.

Cost per closure evaluation beyond DDP: one all-gather of the gradient slices (stage 1's all-reduce
plus all-gather moves 1.5x DDP's bytes; stage 2's reduce-scatter plus all-gather the same as DDP's
all-reduce); per step one all-gather of the fp32 masters under bf16-mixed. Memory during the step:
full fp32 masters (unless they are the parameters) and gradients, 4-8 bytes per parameter, plus the
optimizer's states.

Stage 3 is refused: it keeps 1/N of the parameters per rank, and a replicated step would gather the
whole model and its gradients on every rank at every evaluation, undoing what stage 3 saves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.publish import Stepped, publish
from lightning_zero.zero.step import ShardedOptimizer
from lightning_zero.zero.whole import WholeParam, declared_whole_model

if TYPE_CHECKING:
    from lightning_zero.config import StrategyConfig
    from lightning_zero.zero.reduce import GradReducer
    from lightning_zero.zero.surface import ModelParallelContext


def check_whole_model(
    optimizers: list[torch.optim.Optimizer],
    config: StrategyConfig,
    precision: str,
    holders: Mapping[int, tuple],
    parallel: ModelParallelContext,
) -> None:
    """``ValueError`` before anything is built where a whole-model optimizer cannot step exactly.
    ``holders``: ``id(param) -> the (optimizer, group) holding it``."""
    model_parallel = parallel.tensor is not None or parallel.pipeline is not None
    for optimizer in optimizers:
        if not declared_whole_model(optimizer):
            continue
        name = type(optimizer).__name__
        if getattr(optimizer, "whole_tensor", None) or any("whole_tensor" in g for g in optimizer.param_groups):
            raise ValueError(
                f"{name} declares both whole_model (stepped on every rank over all parameters) and whole_tensor "
                "(each parameter on one owner rank); declare one."
            )
        if config.zero.stage == 3:
            raise ValueError(
                f"{name} needs the whole model's parameters and averaged gradients on every rank at each of its "
                "closure evaluations (its dot products span all parameters), but ZeRO stage 3 keeps 1/N of the "
                "parameters per rank; gathering all of them at every evaluation would undo stage 3. Use stage 1 or "
                f"2 (strategy='zero1' / 'zero2', with offload_optimizer='cpu' if you like): {name} then runs "
                "replicated, as under DDP, while the other optimizers' states stay sharded."
            )
        if precision == "16-mixed":
            raise ValueError(
                f"{name} re-evaluates its closure several times per step, which 16-mixed's loss scaling (a step "
                "skipped on overflow, a scale changed between steps) cannot follow (Lightning refuses AMP with "
                'LBFGS too). Use precision="32-true" or "bf16-mixed".'
            )
        if "nvme" in (config.offload.optimizer_tier, config.offload.parameter_tier):
            raise ValueError(
                f"{name} keeps its states and full fp32 parameters replicated in memory, which the NVMe tiers' "
                'per-slice swap files do not hold. Use offload_optimizer="cpu" or no offload.'
            )
        if model_parallel:
            raise ValueError(
                f"{name} takes dot products over all its parameters, which tensor and pipeline parallelism split "
                "across ranks outside the data-parallel group; use it with data parallelism only."
            )
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(len(holders.get(i, ())) > 1 for i in ids):
            raise ValueError(
                f"a parameter of {name} is also given to another optimizer; give each parameter of a whole-model "
                "optimizer to it alone."
            )


class ReplicatedOptimizer(ShardedOptimizer):
    """The user's whole-model optimizer over full replicated parameters; see the module docstring.
    Takes :class:`ShardedOptimizer`'s arguments; the norms, clipping and gradient preparation of the
    slices are inherited, the step and the optimizer's parameters are its own."""

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: list[FlatBuffer], **kwargs: Any) -> None:
        super().__init__(optimizer, buffers, **kwargs)
        self.kernel = None  # its own class steps the full tensors
        where = {id(p): (b, i) for b in buffers for i, p in enumerate(b.params)}
        #: one record per parameter held in a flat buffer; ``key`` is what the optimizer holds for it
        self.keyed: list[WholeParam] = []
        self.master_params = []
        for g_index, original in enumerate(self.original_params):
            keys: list[torch.Tensor] = []
            for param in original:
                if id(param) not in where:  # frozen: not in a flat buffer, full on every rank already
                    keys.append(param)
                    continue
                b, i = where[id(param)]
                key = torch.empty(0, dtype=b.master.dtype, device=b.master.device)
                self.keyed.append(WholeParam(b, i, g_index, self.rank, key, []))
                keys.append(key)
            self.master_params.append(keys)
        self.got_gradient: set[int] | None = None  # set by the engine before each gradient take (None: all)
        self._full: dict[int, torch.Tensor] = {}  # id(buffer) -> its full masters, during the step
        self._snapshot: list[torch.Tensor] = []

    @contextlib.contextmanager
    def masters(self) -> Iterator[None]:
        """The keys as the optimizer's parameters (LBFGS also keeps its group's list as ``_params``)."""
        with super().masters():
            original = self.optimizer.__dict__.get("_params")
            if original is not None:
                self.optimizer._params = self.optimizer.param_groups[0]["params"]  # type: ignore[attr-defined]
            try:
                yield
            finally:
                if original is not None:
                    self.optimizer._params = original  # type: ignore[attr-defined]

    def note_gradients(self, got: set[int]) -> None:
        self.got_gradient = got

    def add_groups(self, buffers: list[FlatBuffer]) -> None:
        raise ValueError(
            f"optimizer.add_param_group() during fit on {type(self.optimizer).__name__}, which steps replicated over "
            "its parameters, is not supported; give every parameter group to it in configure_optimizers."
        )

    # -- the full tensors of a step --------------------------------------------------------------

    def load(self, snapshot: bool = False) -> None:
        """Full masters into the keys. Where the parameters are in the master's dtype (32-true, also
        offloaded) they are the full masters already: used in place, or copied to the host tier.
        Below it (bf16-mixed) the fp32 masters are all-gathered from the ranks' slices.
        ``snapshot``: keep this rank's master slices to roll back to (:meth:`restore`). Call on all ranks."""
        self._snapshot = [b.master.detach().clone() for b in self.buffers] if snapshot else []
        for b in self.buffers:
            assert b.flat_param is not None  # stages 1/2: persistent buffers
            if b.flat_param.dtype == b.master.dtype:
                same = b.flat_param.device == b.master.device
                self._full[id(b)] = b.flat_param if same else b.flat_param.detach().to(b.master.device)
                continue
            gathered = torch.empty(b.layout.padded_numel, dtype=b.master.dtype, device=b.flat_param.device)
            comm.all_gather(gathered, b.master.detach().to(b.flat_param.device), self.group, label="replicated_step")
            self._full[id(b)] = gathered.to(b.master.device)
        for w in self.keyed:
            slot = w.buffer.layout.slots[w.param_index]
            w.key.data = self._full[id(w.buffer)][slot.offset : slot.offset + slot.numel].view(slot.shape)

    def take_grads(self) -> None:
        """The reduced slices (``master.grad``) into the keys' ``.grad``, full: added to what a key
        still holds (no ``zero_grad`` since the last evaluation, as DDP's ``param.grad`` accumulates);
        a parameter without a gradient this window keeps its ``.grad``. Call on all ranks."""
        full: dict[int, torch.Tensor] = {}
        for b in self.buffers:
            grad = b.master.grad
            if grad is None:
                continue
            assert b.flat_param is not None
            out = torch.empty(b.layout.padded_numel, dtype=grad.dtype, device=b.flat_param.device)
            comm.all_gather(out, grad.to(b.flat_param.device), self.group, label="replicated_step")
            full[id(b)] = out.to(b.master.device)
        for w in self.keyed:
            got = self.got_gradient is None or id(w.param) in self.got_gradient
            if id(w.buffer) not in full or not got:
                continue
            slot = w.buffer.layout.slots[w.param_index]
            grad = full[id(w.buffer)][slot.offset : slot.offset + slot.numel].view(slot.shape)
            w.key.grad = grad if w.key.grad is None else w.key.grad + grad

    def write_params(self) -> None:
        """The keys into the model's parameters and this rank's master slice (every rank holds the
        same keys: no communication). Local."""
        with torch.no_grad():
            for b in self.buffers:
                full = self._full.get(id(b))
                if full is None:
                    continue
                assert b.flat_param is not None
                if full is not b.flat_param:  # (else the keys are views of the parameters themselves)
                    b.flat_param.copy_(full)
                if b.separate_master:
                    start, end = b.layout.shard_range(b.rank)
                    b.master.detach().copy_(full[start:end])

    def restore(self, allgather_bucket_size: int) -> None:
        """Back to the master slices of :meth:`load` (``snapshot``), published. Call on all ranks."""
        with torch.no_grad():
            for b, kept in zip(self.buffers, self._snapshot, strict=True):
                b.master.detach().copy_(kept)
                b.params_from_master()
        publish(self.buffers, self.group, allgather_bucket_size)

    def release(self) -> None:
        """The keys give their memory back."""
        for w in self.keyed:
            w.key.grad = None
            w.key.data = torch.empty(0, dtype=w.key.dtype, device=w.key.device)
        self._full.clear()
        self._snapshot = []

    def step(
        self,
        stepped: Stepped | None = None,
        step_kwargs: Mapping[str, Any] | None = None,
        stepped_by_torch: bool = False,
    ) -> None:
        """The class's own ``step`` over the keys (their gradients from the prepared slices), then the
        keys into the parameters; ``stepped_by_torch``: it already ran (:class:`ReplicatedCall`). No
        publish follows: every rank holds the update. Call on all ranks."""
        if not stepped_by_torch:
            self.load()
            try:
                self.take_grads()
                with self.masters():
                    self.optimizer.step(**(step_kwargs or {}))
                self.write_params()
            finally:
                self.release()
            return
        self.write_params()

    # -- checkpoints -------------------------------------------------------------------------------

    def piece_states(self) -> dict[tuple[int, int], tuple[dict, dict]]:
        """The optimizer's state of each parameter this rank holds a piece of, whole (every rank has
        it), in the checkpoint's per-piece form ``(id(buffer), param_index) -> ({}, state)``. Local."""
        out: dict[tuple[int, int], tuple[dict, dict]] = {}
        local = {(id(b), s.param_index) for b in self.buffers for s in b.shards}
        for w in self.keyed:
            entry = self.optimizer.state.get(w.key)
            if entry and (id(w.buffer), w.param_index) in local:
                out[(id(w.buffer), w.param_index)] = ({}, _host(entry))
        return out

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded optimizer ``state_dict`` (DDP's): every rank takes it whole."""
        saved_groups = state_dict["param_groups"]
        sizes, saved = [len(g) for g in self.original_params], [len(g["params"]) for g in saved_groups]
        if sizes != saved:
            raise ValueError(
                f"the checkpoint's optimizer has parameter groups of sizes {saved} but "
                f"{type(self.optimizer).__name__} here has {sizes}; load it into the same model and "
                "configure_optimizers that wrote it."
            )
        saved_ids = [i for g in saved_groups for i in g["params"]]
        position = {id(p): saved_ids[k] for k, p in enumerate(p for group in self.original_params for p in group)}
        whole = {}
        for w in self.keyed:
            entry = state_dict["state"].get(position[id(w.param)])
            if entry:
                whole[id(w.key)] = _host(entry, device=w.key.device, skip=("master",))
        self.load_slices({}, saved_groups, whole)


def _host(entry: Mapping[str, Any], device: torch.device | str = "cpu", skip: tuple[str, ...] = ()) -> dict:
    """A copy of one optimizer state entry on ``device`` (tensors, also inside lists, cloned)."""

    def copy(value: Any) -> Any:
        if torch.is_tensor(value):
            return value.detach().to(device, copy=True)
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value

    return {k: copy(v) for k, v in entry.items() if k not in skip}


class _NonFinite(Exception):
    """Raised out of the closure on every rank at once (the norm is global) to abandon the step."""


class ReplicatedOwner(Protocol):
    """What a :class:`ReplicatedCall` uses of its engine (:class:`~lightning_zero.zero.engine.ZeroEngine`,
    which imports this module: naming its class here would tie the two into an import cycle)."""

    @property
    def config(self) -> StrategyConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def _reducer(self) -> GradReducer: ...
    def _get(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer: ...
    def _prepare(self, optimizer: torch.optim.Optimizer, inv_scale: float) -> ShardedOptimizer: ...
    def _drop_grads(self, optimizer: torch.optim.Optimizer) -> None: ...
    def grad_norm(self, optimizer: torch.optim.Optimizer, inv_scale: float = 1.0) -> torch.Tensor: ...


class ReplicatedCall:
    """One call of the user's ``optimizer.step(closure=...)`` of a whole-model optimizer; see the
    module docstring. The arguments and the record (``ran``, ``update``, ``overflow``, ``applied``,
    ``output``) are :class:`~lightning_zero.zero.user_step.UserStep`'s. A non-finite gradient at any
    evaluation (with ``check_overflow``) abandons the step: the weights go back to the values before
    it; the optimizer keeps what its ``step`` wrote before that evaluation (LBFGS: its counters)."""

    def __init__(
        self,
        engine: ReplicatedOwner,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any] | None,
        *,
        inv_scale: float,
        check_overflow: bool,
        before_update: Callable[[], None] | None,
        automatic: bool,
    ) -> None:
        self.engine = engine
        sharded = engine._get(optimizer)
        assert isinstance(sharded, ReplicatedOptimizer)
        self.sharded = sharded
        self.user_closure = closure
        self.inv_scale = inv_scale
        self.check_overflow = check_overflow
        self.before_update = before_update
        self.automatic = automatic
        self.ran = self.update = self.overflow = self.applied = False
        self.output: Any = None
        self.evaluations = 0

    def __call__(self, **step_kwargs: Any) -> Any:
        """The user's ``optimizer.step`` with :meth:`closure`; returns what it returns. Call on all ranks."""
        sharded, optimizer = self.sharded, self.sharded.optimizer
        sharded.load(snapshot=self.check_overflow)
        try:
            with sharded.masters():
                # torch calls it between the class's step and the post-hooks (Optimizer.profile_hook_step)
                optimizer._optimizer_step_code = self._complete  # type: ignore[method-assign]  # removed below
                closure = self.closure if self.user_closure is not None else None
                return optimizer.step(closure=closure, **step_kwargs)
        except _NonFinite:
            self.overflow = True
            sharded.restore(self.engine.config.zero.allgather_bucket_size)
            return None
        finally:
            optimizer.__dict__.pop("_optimizer_step_code", None)
            sharded.release()
            if self.ran:  # (a step that never called the closure leaves the window's gradients, as DDP's)
                self.engine._drop_grads(optimizer)

    def closure(self) -> Any:
        """One evaluation: the keys into the parameters, the user's closure, then DDP's gradients in the keys."""
        sharded, engine = self.sharded, self.engine
        if self.evaluations:
            sharded.write_params()  # the optimizer moved the keys since the last evaluation
        assert self.user_closure is not None
        result = self.user_closure()
        self.evaluations += 1
        self.ran = True
        self.update = not (result is None and self.automatic)
        engine._prepare(sharded.optimizer, self.inv_scale)
        if self.before_update is not None:
            self.before_update()
        if self.update and self.check_overflow and not bool(torch.isfinite(engine.grad_norm(sharded.optimizer))):
            raise _NonFinite
        sharded.note_gradients(set(engine._reducer.got_gradient))
        sharded.take_grads()
        engine._drop_grads(sharded.optimizer)  # the next evaluation is a window of its own
        return self._averaged(result)

    def _averaged(self, loss: Any) -> Any:
        """``loss`` averaged over the ranks (the loss of the averaged gradient), for the optimizer's
        decisions (LBFGS's line search, its convergence checks) to be every rank's; returned as it is
        where some rank's closure returned none. Call on all ranks."""
        value = float(loss) if loss is not None else 0.0
        pair = torch.tensor([value, 0.0 if loss is None else 1.0], dtype=torch.float64, device=self.engine.device)
        comm.all_reduce(pair, self.sharded.group, label="replicated_loss")
        world = comm.world_size(self.sharded.group)
        if loss is None or int(pair[1]) != world:
            return loss
        mean = pair[0] / world
        return mean.to(device=loss.device, dtype=loss.dtype) if torch.is_tensor(loss) else type(loss)(mean)

    def _complete(self) -> None:
        self.sharded.write_params()
        self.applied = True
