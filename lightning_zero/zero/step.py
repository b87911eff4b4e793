"""Step 4 of the data path, **step**: the user's optimizer on this rank's slices only.

The optimizer the LightningModule returned is kept (its class, hyperparameters, parameter groups,
and identity, so LR schedulers and ``self.optimizers()`` keep working), but it steps the fp32 ``master`` slices of the flat buffers of each group (its groups hold them
only while torch's ``step()`` runs: :meth:`ShardedOptimizer.masters`). Its ``state`` therefore holds
optimizer states for this rank's slice only: 12/N bytes per parameter for Adam.

This is exact only for elementwise optimizers, whose update of an element reads that element
alone: slices cut through parameters. Parameter groups of whole-tensor optimizers (Muon, Adafactor,
one declared ``whole_tensor = True``) are stepped by parameter on one owner rank instead
(:mod:`lightning_zero.zero.whole`); LBFGS, whose update couples all parameters and whose closure
re-evaluates the model, steps replicated over full parameters (:mod:`lightning_zero.zero.replicated`);
undeclared optimizers named like whole-tensor ones are rejected.

Checkpoints are written per piece (:mod:`lightning_zero.checkpoint`) and loaded back through
:meth:`ShardedOptimizer.load_slices`; an unsharded optimizer state (a plain DDP checkpoint, or the
earlier single-file format with the fp32 masters under ``"master"``) loads through
:meth:`ShardedOptimizer.load_consolidated_state_dict`, so a DDP checkpoint loads into a ZeRO run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.publish import Stepped
from lightning_zero.zero.step_kernels import KernelStep
from lightning_zero.zero.swap_grads import Scale, squared_norm
from lightning_zero.zero.whole import WholeTensorStep, declared_whole_model, declared_whole_tensor, whole_groups

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
_WHOLE_TENSOR_HINTS = ("lamb", "lars", "adafactor", "lbfgs", "shampoo", "muon", "sparse", "soap", "lion8bit")


def _refuse_lazy(cls: type) -> None:
    """SparseAdam's update of a row depends on whether that row got a gradient (lazy moments), which
    the dense flat gradient buffers of ZeRO cannot tell apart from a zero gradient."""
    if issubclass(cls, torch.optim.SparseAdam):
        raise ValueError(
            f"{cls.__name__} updates only the rows of a sparse gradient (lazy Adam), but ZeRO reduces every "
            "gradient into dense flat buffers (a sparse embedding gradient becomes its dense equivalent), where "
            "a row without gradient cannot be told from a zero one. Use SGD or Adagrad (the same updates as with "
            "the sparse gradient), or Adam/AdamW (the moments of every row decay each step), or DDP."
        )


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Raise ``ValueError`` unless ``optimizer`` can be stepped exactly: by flat slices (elementwise),
    by parameter (whole-tensor, :mod:`lightning_zero.zero.whole`) or replicated over all parameters
    (whole-model, :mod:`lightning_zero.zero.replicated`)."""
    from lightning_zero import ops

    cls = type(optimizer)
    _refuse_lazy(cls)
    name = cls.__name__
    if declared_whole_model(optimizer):
        return  # stepped replicated over the full parameters (zero/replicated.py), checked there
    declared = declared_whole_tensor(optimizer)
    groups = whole_groups(optimizer)
    if declared is not None or groups:
        return  # the optimizer (or its groups) says how it must be stepped
    if cls in ELEMENTWISE_OPTIMIZERS or cls in (ops.CPUAdam, ops.FusedAdam, ops.Lion):
        return
    if issubclass(cls, ELEMENTWISE_OPTIMIZERS) and not issubclass(cls, (ops.CPULamb, ops.FusedLamb)):
        return  # a subclass (a counter, a logging hook) is trusted to stay elementwise; it steps itself
    if cls in (ops.CPULamb, ops.FusedLamb):
        return  # stepped by the shard-aware LAMB kernels (lightning_zero.zero.step_kernels)
    if any(hint in name.lower() for hint in _WHOLE_TENSOR_HINTS):
        raise ValueError(
            f"{name} computes its update from whole-tensor statistics (norms or factored moments), but ZeRO "
            "steps contiguous slices of flat buffers that cut through parameters, so its updates would be wrong. "
            f"If each parameter's update reads only that parameter, declare it: set {name}.whole_tensor = True "
            f"(each parameter is then stepped whole on one owner rank), or {name}.whole_model = True if its update "
            "reads all parameters at once, as LBFGS's (stepped replicated, as under DDP); for LAMB use the shard-aware "
            "lightning_zero.ops.CPULamb / FusedLamb; otherwise use an elementwise optimizer (SGD, Adam, AdamW, ...)."
        )
    if not allow_untested:
        raise ValueError(
            f"{name} is not known to be elementwise. ZeRO steps slices of parameters, which is exact only when "
            "each element's update depends on that element alone. If that holds for your optimizer, pass "
            "ZeroStrategy(allow_untested_optimizer=True); if its update of a parameter reads the whole parameter "
            f"(norms, matrix products), set {name}.whole_tensor = True (or a param group's 'whole_tensor': True) "
            "to step each parameter whole on one owner rank; otherwise use SGD, Adam, AdamW or another "
            "torch.optim elementwise optimizer."
        )


def state_tensors(entry: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors of one optimizer state entry, also those inside lists (LBFGS's history)."""
    out: list[torch.Tensor] = []
    for value in entry.values():
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if torch.is_tensor(v))
    return out


def _norm_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _adagrad_initial(optimizer: torch.optim.Optimizer, state: dict) -> bool:
    """torch.optim.Adagrad creates its state in __init__ (step 0, sum = initial_accumulator_value):
    that is not a stepped optimizer, and is re-created for the masters below."""
    return isinstance(optimizer, torch.optim.Adagrad) and set(state) == {"step", "sum"} and float(state["step"]) == 0


def _adagrad_init_state(optimizer: torch.optim.Optimizer) -> None:
    """Adagrad's constructor state for the masters (its own step() expects it to exist)."""
    for group in optimizer.param_groups:
        for master in group["params"]:
            optimizer.state[master] = {
                "step": torch.tensor(0.0),
                "sum": torch.full_like(master, float(group["initial_accumulator_value"])),
            }


def prefer_fused(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]) -> bool:
    """Let torch's ``Adam``/``AdamW`` step the master slices with its fused kernel (``fused=True``)
    where the user chose no implementation (``fused`` and ``foreach`` both None) and the masters'
    device and dtypes support it. The default otherwise is the ``foreach`` implementation on CUDA,
    whose intermediate results (``exp_avg_sq.sqrt()``, the update) are temporaries the size of the
    whole shard every step, or the single-tensor one on CPU, which allocates them per flat buffer;
    the fused kernel updates in place in one pass (DeepSpeed likewise defaults to its FusedAdam).
    The update is the same up to rounding (a few ulps). Returns whether it switched."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not masters:
        return False
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    if any(m.device.type not in supported or not m.is_floating_point() for m in masters):
        return False
    groups = [
        g
        for g in optimizer.param_groups
        if g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable")
    ]
    for g in groups:
        g["fused"] = True
    return bool(groups)


class ShardedOptimizer:
    """The user's optimizer rewired to this rank's master slices; see the module docstring.

    Args:
        optimizer: the user's optimizer (its groups are rewired in place).
        buffers: the flat buffers of its parameters (a buffer of parameters several optimizers
            hold is in each one's list; each keeps its own state for the same master slice).
        group_of: ``id(buffer) -> index of this optimizer's parameter group`` the buffer joins
            (default: the buffer's own ``optimizer_group``).
        group: the data-parallel group.
        tensor_parallel_group: parameters marked ``tensor_parallel`` hold different shards on its
            ranks; the others are replicas, counted on tensor-parallel rank 0 only (``None``: none).
        pipeline_parallel_group: every stage holds other parameters: norms add up over it.
        counted_elsewhere: ids of parameters tied across stages whose norm another stage counts.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buffers: list[FlatBuffer],
        *,
        group_of: dict[int, int] | None = None,
        group: comm.ProcessGroup,
        tensor_parallel_group: comm.ProcessGroup = None,
        pipeline_parallel_group: comm.ProcessGroup = None,
        counted_elsewhere: frozenset[int] = frozenset(),
    ) -> None:
        if any(len(state) and not _adagrad_initial(optimizer, state) for state in optimizer.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__} already has optimizer state before ZeRO set it up; create it in "
                "configure_optimizers and do not step it before training starts."
            )
        self.optimizer = optimizer
        self.buffers = buffers
        self.group_of = (
            dict(group_of)
            if group_of is not None
            else {id(b): b.optimizer_group for b in buffers if b.optimizer_group is not None}
        )
        self.group = group
        self.rank = comm.rank(group)
        self.tensor_parallel_group = tensor_parallel_group
        self.pipeline_parallel_group = pipeline_parallel_group
        self.counted_elsewhere = counted_elsewhere
        self.original_params = [list(g["params"]) for g in optimizer.param_groups]
        groups = whole_groups(optimizer)
        #: the parameters of whole-tensor groups, stepped by parameter (None: every group is elementwise)
        self.whole = WholeTensorStep(buffers, self.group_of, groups, group) if groups else None
        self.master_params = [
            self.whole.owned(g_index)
            if self.whole is not None and g_index in groups
            else [b.master for b in buffers if self.group_of[id(b)] == g_index]
            for g_index in range(len(optimizer.param_groups))
        ]
        optimizer.state.clear()
        if isinstance(optimizer, torch.optim.Adagrad):
            _adagrad_init_state(optimizer)
        # the compiled kernels step flat slices of every group at once: not with a whole-tensor group
        self.kernel = None if groups else KernelStep.for_optimizer(optimizer, buffers, group, self.group_of)
        if self.kernel is None:
            prefer_fused(optimizer, [m for masters in self.master_params for m in masters])
        self._finite_after_clip = False  # see known_finite

    @contextmanager
    def masters(self) -> Iterator[None]:
        """Inside the block the optimizer's groups hold this rank's master slices, for torch's own
        ``step()`` and ``load_state_dict()``. Outside it they hold the model's parameters, as the user
        built them: Lightning's ``toggle_optimizer``, fine-tuning callbacks and the user's code read
        ``param_groups`` to find parameters (``optimizer.state`` stays keyed by the masters)."""
        self.check_groups()
        for param_group, masters in zip(self.optimizer.param_groups, self.master_params, strict=True):
            param_group["params"] = masters
        try:
            yield
        finally:
            # load_state_dict() replaces the group dicts: restore into the ones there now
            for param_group, original in zip(self.optimizer.param_groups, self.original_params, strict=True):
                param_group["params"] = original

    def add_groups(self, buffers: list[FlatBuffer]) -> None:
        """Take the parameter groups added to the optimizer since setup (``add_param_group`` during
        fit), whose parameters ``buffers`` now hold (stages 1/2: :meth:`ZeroEngine.add_param_groups`)."""
        if self.whole is not None or whole_groups(self.optimizer):
            raise ValueError(
                f"optimizer.add_param_group() during fit on {type(self.optimizer).__name__}, which has whole-tensor "
                "parameter groups, is not supported (their owners are assigned at setup). Give every parameter "
                "group to the optimizer in configure_optimizers (a group that should not train yet can have lr=0)."
            )
        self.buffers.extend(buffers)
        self.group_of.update({id(b): b.optimizer_group for b in buffers if b.optimizer_group is not None})
        for g_index in range(len(self.master_params), len(self.optimizer.param_groups)):
            self.master_params.append([b.master for b in buffers if b.optimizer_group == g_index])
            self.original_params.append(list(self.optimizer.param_groups[g_index]["params"]))
        self.kernel = KernelStep.for_optimizer(self.optimizer, self.buffers, self.group, self.group_of)

    def check_groups(self) -> None:
        """Refuse parameter groups added after setup, naming what to do instead."""
        if len(self.optimizer.param_groups) != len(self.master_params):
            raise ValueError(
                f"{type(self.optimizer).__name__} has {len(self.optimizer.param_groups)} parameter groups but ZeRO "
                f"partitioned {len(self.master_params)}: optimizer.add_param_group() under stage 3 (e.g. Lightning's "
                "BackboneFinetuning) is not supported, because its frozen parameters are sharded without a master "
                "(stages 1 and 2 take new groups at the next batch). Give every parameter group to the optimizer in "
                "configure_optimizers (a group that should not train yet can have lr=0 and be raised by an LR "
                "scheduler or a callback)."
            )

    # -- gradients ----------------------------------------------------------------------------

    def prepare(self, inv_scale: float, given: dict[int, torch.Tensor | None] | None = None) -> None:
        """Expose the reduced slices as ``master.grad`` (fp32, unscaled by ``inv_scale``); the buffers
        in ``given`` (``id(buffer) -> gradient``, shared parameters) get that one, None: skipped."""
        self.check_groups()
        self._finite_after_clip = False
        given = given or {}
        for b in self.buffers:
            if id(b) in given:
                b.master.grad = given[id(b)]
                continue
            if b.grad_tier is not None:
                # the gradient disk tier: master.grad stays on disk until the kernel reads it (zero/swap_grads.py)
                b.defer_grad(inv_scale)
                continue
            grad = b.grad_for_step()
            if inv_scale != 1.0:
                grad.mul_(inv_scale)
            b.master.grad = grad

    def note_gradients(self, got: set[int]) -> None:
        """The ids of the parameters that received a gradient this window: the whole-tensor step skips
        the others, as DDP's optimizer skips a ``None`` gradient."""
        if self.whole is not None:
            self.whole.got_gradient = got

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over all ranks' slices (fp32 scalar; padding is zero), replicas of the
        tensor-parallel group and copies of pipeline-tied parameters counted once. Call on all ranks."""
        device = self.buffers[0].master.device if self.buffers else torch.device("cpu")
        # float64 when any master is (a float64 sub-module kept under "32-true", or "64-true")
        dtype = max((_norm_dtype(b.master) for b in self.buffers), key=lambda d: d.itemsize, default=torch.float32)
        local = torch.zeros((), dtype=dtype, device=device)
        tp, pp = self.tensor_parallel_group, self.pipeline_parallel_group
        replicas_counted = tp is None or comm.rank(tp) == 0  # (None is not "the default group" here)
        for b in self.buffers:
            tier = b.grad_tier if b.pending_grad is not None else None
            if tier is not None and replicas_counted and not self.counted_elsewhere:
                local += tier.squared(b)  # the sum of squares taken when it was reduced
                continue
            grad = b.master.grad if tier is None else tier.read_step_grad(b)
            if grad is None:
                continue
            if replicas_counted and not self.counted_elsewhere:
                local += squared_norm(grad)  # the disk tier's function too (swap_grads.py)
                continue
            for piece in b.shards:
                param = b.params[piece.param_index]
                if id(param) in self.counted_elsewhere:
                    continue
                if replicas_counted or getattr(param, "tensor_parallel", False):
                    local += squared_norm(grad[piece.shard_offset : piece.shard_offset + piece.numel])
        comm.all_reduce(local, self.group)
        if tp is not None:
            comm.all_reduce(local, tp)
        if pp is not None:
            comm.all_reduce(local, pp)
        return local.sqrt()

    def clip_grad_norm(self, max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
        """Scale gradients so that their global norm is at most ``max_norm``; returns the norm before.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_``, so clipping matches DDP.
        """
        norm = self.grad_norm() if norm is None else norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        pending = [b.pending_grad for b in self.buffers if b.pending_grad is not None]
        if pending:
            # Clipping by a finite norm leaves every gradient finite (each element only shrinks), so
            # the overflow check after it needs no second read of the slices (known_finite). On the
            # host: the gradient tier is in host memory, so this costs no device sync.
            fresh = all(not p.ops for p in pending)
            self._finite_after_clip = fresh and bool(torch.isfinite(norm))
        for b in self.buffers:
            if b.pending_grad is not None:  # applied when the step reads it (zero/swap_grads.py)
                b.pending_grad.ops.append(Scale(coef))
            elif b.master.grad is not None:
                b.master.grad.mul_(coef.to(b.master.grad.dtype))
        return norm

    def known_finite(self) -> bool:
        """The gradients are known to be finite without reading them: they rest on the disk tier and
        were only clipped, once, by a finite global norm since they were reduced (otherwise the
        overflow check computes the norm again)."""
        return self._finite_after_clip

    def clip_grad_value(self, clip_value: float) -> None:
        self._finite_after_clip = False
        for b in self.buffers:
            if b.pending_grad is not None:
                b.pending_grad.ops.append(lambda grad: grad.clamp_(-clip_value, clip_value))
            elif b.master.grad is not None:
                b.master.grad.clamp_(-clip_value, clip_value)

    def materialize_grads(self) -> None:
        """Gradients left on the disk tier into ``master.grad`` (code that reads them all at once:
        ``full_gradients``); their memory is the old path's from here to the step."""
        self._finite_after_clip = False  # the caller may edit them
        for b in self.buffers:
            if b.grad_tier is not None:
                b.grad_tier.materialize(b)

    def step(
        self,
        stepped: Stepped | None = None,
        step_kwargs: Mapping[str, Any] | None = None,
        stepped_by_torch: bool = False,
    ) -> None:
        """Update the master slices and write them into the parameter slices (the kernels do both in
        one pass; after torch's step the cast copy is a second one). ``stepped`` (pipelined, kernels
        only): called with each buffer once it is updated (:class:`~lightning_zero.zero.publish.Publisher`);
        torch's own ``step()`` updates all buffers at once, so there it is called after it.
        ``step_kwargs``: what the user passed to ``optimizer.step(...)`` (a ``closure`` there returns
        the loss already computed: the closure ran before the reduction), handed to the optimizer's
        own ``step`` as under DDP; the compiled Adam/AdamW kernels take none. ``stepped_by_torch``:
        the user's own ``step`` already updated the masters (:mod:`lightning_zero.zero.user_step`)."""
        if self.kernel is not None:
            self.kernel.step(self.tensor_parallel_group, stepped)
            return
        if not stepped_by_torch:
            if self.whole is not None:
                self.whole.load()  # each owned parameter whole, with its whole gradient
            try:
                with self.masters():
                    self.optimizer.step(**(step_kwargs or {}))
            except BaseException:
                if self.whole is not None:
                    self.whole.release()
                raise
        if self.whole is not None:
            self.whole.store()  # the updated pieces back into every holder's master slice
        for b in self.buffers:
            # the parameter disk tier: the shard has memory only while written (zero/swap.py)
            with b.shard_tier.rewrite([b]) if b.shard_tier is not None else nullcontext():
                b.params_from_master()
            if stepped is not None:
                stepped(b, None)

    def host_staging(self) -> list[torch.Tensor]:
        """Host buffers the step keeps beside the accelerator's parameters: the (pinned) copies the
        offloaded kernel writes the updated 16-bit slices into before they go to the device."""
        return self.kernel.staging() if self.kernel is not None else []

    @property
    def pipelines(self) -> bool:
        """Whether :meth:`step` can hand out each buffer as soon as it is updated (the kernels)."""
        return self.kernel is not None

    def release_grads(self) -> None:
        self._finite_after_clip = False
        for b in self.buffers:
            b.master.grad = None
            b.drop_pending_grad()

    # -- checkpoints -------------------------------------------------------------------------------

    def load_slices(
        self,
        state: dict[int, dict[str, Any]],
        saved_groups: list[dict[str, Any]],
        whole_state: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        """Load per-buffer states (``id(buffer) -> {key: slice or scalar}``), the whole states of the
        parameters this rank owns in whole-tensor groups (``id(key) -> state``) and the
        hyperparameters of ``saved_groups`` (their ``params`` entries are ignored) into the optimizer."""
        # Optimizer.load_state_dict keys are positions in the optimizer's own parameter order (group
        # by group), which under stage 3 is not the order of self.buffers.
        position = {id(m): k for k, m in enumerate(m for masters in self.master_params for m in masters)}
        by_position = {position[id(b.master)]: state[id(b)] for b in self.buffers if id(b) in state}
        by_position.update({position[key]: value for key, value in (whole_state or {}).items()})
        groups, start = [], 0
        for g_index, saved in enumerate(saved_groups):
            group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            count = len(self.master_params[g_index])
            group["params"] = list(range(start, start + count))
            start += count
            groups.append(group)
        with self.masters():
            self.optimizer.load_state_dict({"state": by_position, "param_groups": groups})

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded optimizer ``state_dict`` (a plain optimizer's, or our earlier
        single-file format); every rank keeps its slice."""
        saved_groups = state_dict["param_groups"]
        sizes = [len(g) for g in self.original_params]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(
                f"the checkpoint's optimizer has parameter groups of sizes {saved_sizes} but "
                f"{type(self.optimizer).__name__} here has {sizes}; load it into the same model and "
                "configure_optimizers that wrote it."
            )
        # Its keys are positions in the original parameter order; ours are the same parameters.
        saved_ids = [i for g in saved_groups for i in g["params"]]
        position = {id(p): saved_ids[k] for k, p in enumerate(p for group in self.original_params for p in group)}
        full_state = state_dict["state"]
        state: dict[int, dict[str, Any]] = {}
        whole_state: dict[int, dict[str, Any]] = {}
        if self.whole is not None:
            for w in self.whole.owned_params():  # the owner takes the parameter's entry as it is
                entry = full_state.get(position[id(w.param)])
                if entry:
                    whole_state[id(w.key)] = {
                        k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items() if k != "master"
                    }
        skip = {id(b) for b in self.whole.buffers} if self.whole is not None else set()
        for b in self.buffers:
            if id(b) in skip:  # only the fp32 masters some saves carry (our earlier single-file format)
                entries = [full_state.get(position[id(p)], {}) for p in b.params]
                masters = self._slice_state(b, [{"master": e["master"]} if "master" in e else {} for e in entries])
                if "master" in masters and b.separate_master:
                    b.master.copy_(masters["master"])
                continue
            shard_state = self._slice_state(b, [full_state.get(position[id(p)], {}) for p in b.params])
            master = shard_state.pop("master", None)
            if master is not None and b.separate_master:
                b.master.copy_(master)
            if shard_state:
                state[id(b)] = shard_state
        self.load_slices(state, saved_groups, whole_state)

    @staticmethod
    def _slice_state(b: FlatBuffer, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's slice of every per-parameter state tensor; scalars taken as they are."""
        out: dict[str, Any] = {}
        keys = sorted({key for entry in entries for key in entry})
        for key in keys:
            template = next(entry[key] for entry in entries if key in entry)
            if not (torch.is_tensor(template) and template.dim() > 0):
                out[key] = template
                continue
            shard = torch.zeros(b.layout.shard_numel, dtype=template.dtype, device=b.master.device)
            for piece in b.shards:
                entry = entries[piece.param_index]
                if key in entry:
                    source = entry[key].reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
                    shard[piece.shard_offset : piece.shard_offset + piece.numel].copy_(source)
            out[key] = shard
        return out
