"""``OffloadPrecision``: compute dtype, fp32 master weights, loss scaling, and where states live.

Under ZeRO the precision strings mean what they mean in DeepSpeed:

============  ===================  ======================  =============================================
precision     parameters, grads    master + optim states   forward
============  ===================  ======================  =============================================
32-true       fp32                 fp32 (master = params)  as written
bf16-mixed    bf16                 fp32, separate          under ``torch.autocast(bfloat16)``
16-mixed      fp16                 fp32, separate          under ``torch.autocast(float16)``; dynamic loss scaling
bf16-true     bf16                 bf16 (master = params)  floating inputs cast to bf16
64-true       fp64                 fp64 (master = params)  floating inputs cast to fp64, as Lightning's
============  ===================  ======================  =============================================

``OffloadPrecision("bf16-mixed", param_dtype="fp32")`` is Lightning's DDP "bf16-mixed" instead: fp32
parameters and gradients (the masters themselves), forward under ``torch.autocast(bfloat16)``.
Under "32-true" each parameter keeps its own dtype (a float64 sub-module stays float64), as under DDP.

"64-true" also builds ``configure_model`` in float64 (the default dtype while it runs), as Lightning's
``DoublePrecision`` does, so its random initialization is DDP's under "64-true".

so the per-rank bytes follow the ZeRO formulas (2 bytes of parameters and of gradients, 12 of
master and Adam states, per parameter). "16-mixed" scales the loss by a dynamic factor: a step whose
gradients overflow is skipped and the scale halves; after ``growth_interval`` good steps it doubles.
The scaler's state is saved in checkpoints through Lightning's precision-plugin state.

Lightning's ``ThroughputMonitor`` (FLOP/s and MFU) looks up the compute dtype of a run by the class of
its precision plugin and counts every plugin it does not know as fp32, whose peak is far below the bf16
or fp16 peak of a GPU. ``OffloadPrecision`` therefore derives from Lightning's ``HalfPrecision`` and
declares its compute dtype where that plugin does (``_desired_input_dtype``): the monitor then measures
MFU against the peak of the dtype the matmuls really run in (bf16 for "bf16-mixed" and "bf16-true",
fp16 for "16-mixed", fp32 for "32-true", fp64 for "64-true"). Every method ``HalfPrecision`` defines is
overridden here; only the declaration is inherited.

The strategy always runs with this plugin: :class:`~lightning_zero.ZeroStrategy` converts whatever
plugin Lightning assigns it (Lightning replaces a named strategy's plugin) into an ``OffloadPrecision``
with the same precision string.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_zero.config import PRECISIONS, LossScaleConfig, NvmeConfig, OffloadConfig, normalize_precision
from lightning_zero.exposure import reads_step_grads
from lightning_zero.hardware import warn_if_slow_bf16
from lightning_zero.zero import fp32_norm_params

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_zero.zero import ZeroEngine


class DynamicLossScaler:
    """The loss scale of "16-mixed" and its update rule (see :class:`~lightning_zero.config.LossScaleConfig`)."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = float(config.initial_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


class OffloadPrecision(HalfPrecision):
    """Precision plugin of :class:`~lightning_zero.ZeroStrategy`.

    A ``HalfPrecision`` subclass only so that Lightning's ``ThroughputMonitor`` reads the compute dtype
    (see the module docstring); none of ``HalfPrecision``'s behaviour is used.

    Args:
        precision: "32-true", "bf16-mixed", "16-mixed" or "bf16-true" (see the module docstring).
        offload_optimizer: fp32 master weights, gradient slices and optimizer states in host memory,
            the step on the CPU (ZeRO-Offload); "nvme": masters and states in files under ``nvme.path``.
        offload_parameters: stage 3: parameter shards in host memory too, gathered to the device on demand.
        pin_memory: page-lock the host buffers when the device is a GPU.
        loss_scale: dynamic loss scaling options for "16-mixed" (ignored otherwise).
        nvme: the disk tier's path and I/O knobs (:class:`~lightning_zero.config.NvmeConfig`).
        param_dtype: ``None`` (default: DeepSpeed's mixed precision, 16-bit parameters beside fp32
            masters) or "fp32" with "bf16-mixed" (Lightning's DDP and FSDP semantics:
            parameters and gradients stay fp32, the fp32 parameters are the masters, and only
            ``torch.autocast`` computes in 16 bits). Costs 4 bytes per parameter of parameters and
            of gradients instead of 2, and saves the separate 4-byte master.
    """

    def __init__(
        self,
        precision: str | int = "32-true",
        offload_optimizer: bool | str = False,
        offload_parameters: bool | str = False,
        pin_memory: bool = True,
        loss_scale: LossScaleConfig | None = None,
        nvme: NvmeConfig | None = None,
        param_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.precision = normalize_precision(precision)  # type: ignore[assignment]  # Lightning types it as its Literal
        if loss_scale is not None and not isinstance(loss_scale, LossScaleConfig):
            raise ValueError(
                f"loss_scale={loss_scale!r} must be a lightning_zero.LossScaleConfig (e.g. "
                "LossScaleConfig(initial_scale=2**16)) or None."
            )
        self.offload = OffloadConfig(
            offload_optimizer=offload_optimizer, offload_parameters=offload_parameters, pin_memory=pin_memory, nvme=nvme
        )
        if self.offload.offload_optimizer and self.precision == "64-true":
            raise ValueError(
                "precision='64-true' with offload_optimizer=True: the CPU optimizer kernels step fp32 masters; "
                "use offload_optimizer=False for float64 training (the step then runs torch's optimizer)."
            )
        if self.offload.offload_optimizer and self.precision == "bf16-true":
            raise ValueError(
                "precision='bf16-true' keeps no fp32 master, but offload_optimizer=True steps fp32 masters on the "
                "CPU; use precision='bf16-mixed' (bf16 parameters, fp32 master and states in host memory)."
            )
        self.compute_dtype, self.separate_master = PRECISIONS[self.precision]
        if param_dtype not in (None, "fp32", "float32", torch.float32):
            raise ValueError(
                f"param_dtype={param_dtype!r}: use None (16-bit parameters and fp32 masters, as DeepSpeed) or 'fp32' "
                "(fp32 parameters under torch.autocast, as Lightning's DDP under mixed precision)."
            )
        if param_dtype is not None and self.precision != "bf16-mixed":
            raise ValueError(
                f"param_dtype={param_dtype!r} with precision={self.precision!r}: fp32 parameters under autocast are "
                "available with precision='bf16-mixed' (the one checked against Lightning's DDP); a '-true' "
                "precision computes in its own dtype, and '32-true' keeps fp32 parameters already."
            )
        #: fp32 parameters under autocast (``param_dtype="fp32"``): the engine runs as under "32-true"
        self.fp32_params = param_dtype is not None
        self.scaler = DynamicLossScaler(loss_scale or LossScaleConfig()) if self.precision == "16-mixed" else None
        self.device_type = "cpu"
        #: optimizer steps skipped for non-finite gradients ("16-mixed" counts in ``scaler.skipped_steps``)
        self.nonfinite_steps = 0
        self._told_exposed = False  # the one-time note on expose_param_grads=None
        self._engine: ZeroEngine | None = None
        self._pipelined = False

    @property
    def engine_precision(self) -> str:
        """The precision the ZeRO engine builds its flat buffers for: "32-true" (fp32 parameters,
        no separate master) under ``param_dtype="fp32"``, else :attr:`precision`."""
        return "32-true" if self.fp32_params else self.precision

    @property
    def _desired_input_dtype(self) -> torch.dtype:  # type: ignore[override]  # an attribute in HalfPrecision
        """The compute dtype, under the name Lightning's ThroughputMonitor reads for ``HalfPrecision``."""
        return self.compute_dtype

    def attach(self, engine: ZeroEngine | None, device: torch.device, pipelined: bool = False) -> None:
        """Called by the strategy in ``setup``: the engine that owns the gradients, the device, and
        whether a pipeline schedule runs every backward inside ``training_step`` (Lightning's
        backward call is then a no-op here; the strategy leaves ``Strategy.backward`` as Lightning's)."""
        self._engine = engine
        self.device_type = device.type
        self._pipelined = pipelined
        warn_if_slow_bf16(self.precision, device)

    # -- module and forward -------------------------------------------------------------------

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        if self.precision == "64-true":
            return _default_dtype(torch.float64)
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast floating parameters (and for "bf16-true" also buffers) to the compute dtype.

        Parameters already of that dtype (those in ZeRO's flat buffers) keep their storage. "32-true"
        casts nothing, as Lightning's: every parameter keeps its dtype (ZeRO's flat buffers too).
        Under "bf16-mixed" and "16-mixed" batch-norm weights stay fp32 beside their fp32 running
        statistics (:func:`~lightning_zero.zero.build.fp32_norm_params`).
        """
        if self.engine_precision == "32-true":
            return module
        if self.precision in ("bf16-true", "64-true"):
            for buffer in list(module.buffers()):
                if buffer.is_floating_point() and buffer.dtype != self.compute_dtype:
                    buffer.data = buffer.data.to(self.compute_dtype)
        kept = fp32_norm_params(module) if self.separate_master else frozenset()
        for param in module.parameters():
            if id(param) in kept:
                continue
            if param.is_floating_point() and param.dtype != self.compute_dtype:
                param.data = param.data.to(self.compute_dtype)
        return module

    # HalfPrecision types its forward_context as a generator context manager; any context manager works
    def forward_context(self) -> contextlib.AbstractContextManager:  # type: ignore[override]
        if self.separate_master:
            return torch.autocast(self.device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def convert_input(self, data: Any) -> Any:
        if self.precision not in ("bf16-true", "64-true"):
            return data
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t
        )

    # -- backward and step --------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]  # Lightning's takes Module
        if self._pipelined:
            return tensor  # the schedule already ran backward (and its hooks) in training_step
        if self._engine is not None:
            self._engine.release_window()  # autograd must not add into exposed .grad (expose_param_grads)
        tensor = super().pre_backward(tensor, module)
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def backward(  # type: ignore[override]  # Lightning's names optimizer Steppable
        self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if not self._pipelined:
            super().backward(tensor, model, optimizer, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]  # Lightning's takes Module
        if self._pipelined:
            return tensor
        if self._engine is not None:
            self._engine.backward_done()
            if self._engine.config.zero.expose_param_grads is not False and not module.automatic_optimization:
                self._engine.expose_window(module, 1.0 / self.loss_scale)
                if self._engine.config.zero.expose_param_grads is None and not self._told_exposed:
                    self._told_exposed = True
                    rank_zero_info(
                        "ZeRO, manual optimization: param.grad holds the averaged gradient after each "
                        "manual_backward, as under DDP (stage 3: this rank's piece of a sharded parameter), "
                        "at the cost of an all-gather and full-size gradients until the step (stages 1/2). "
                        "ZeroStrategy(expose_param_grads=False) keeps ZeRO's gradient memory."
                    )
        tensor = super().post_backward(tensor, module)
        return tensor / self.scaler.scale if self.scaler is not None else tensor

    def optimizer_step(  # type: ignore[override]  # Lightning's takes Steppable and Module
        self, optimizer: torch.optim.Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Call the user's ``optimizer.step(closure=...)`` as Lightning does under DDP (its hooks,
        a subclass's code, a mock), with ZeRO's work inside: the closure handed to it runs forward and
        backward, exposes this rank's unscaled gradient slices and runs the user's
        ``on_before_optimizer_step`` hooks and clipping; the optimizer's own arithmetic then updates
        the slices, which are published (:mod:`lightning_zero.zero.user_step`)."""
        engine = self._engine
        if engine is None or not engine.manages(optimizer):
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        policy = engine.config.zero.on_nonfinite
        call = engine.step_through(
            optimizer,
            closure,
            inv_scale=1.0 / self.loss_scale,
            check_overflow=self.scaler is not None or policy != "ignore",
            before_update=lambda: self._before_update(model, optimizer),
            automatic=model.automatic_optimization,
            step_kwargs=kwargs,
        )
        if call.ran and call.update:
            self._after_step(call.overflow, model.trainer.global_step, policy)
        return call.output

    def zero_step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        before_update: Callable[[], None] | None = None,
        update: bool = True,
        step_kwargs: Mapping[str, Any] | None = None,
        closure: Callable[[], Any] | None = None,
    ) -> Any:
        """One ZeRO optimizer step with this plugin's loss scale and non-finite policy, the engine
        calling the optimizer's step itself (Fabric's strategy; the Trainer's :meth:`optimizer_step`
        goes through the user's own ``step`` instead). ``step`` is the number of optimizer steps so
        far, for the messages. ``closure``: a whole-model optimizer's (LBFGS), which its own ``step``
        evaluates (:meth:`ZeroEngine.step_through`); returns what that ``step`` returns. Call on all ranks."""
        assert self._engine is not None  # attached by the strategy's setup
        policy = self._engine.config.zero.on_nonfinite
        if closure is not None:
            call = self._engine.step_through(
                optimizer,
                closure,
                inv_scale=1.0 / self.loss_scale,
                check_overflow=self.scaler is not None or policy != "ignore",
                before_update=before_update,
                automatic=False,
                step_kwargs=step_kwargs,
            )
            if call.ran and call.update:
                self._after_step(call.overflow, step, policy)
            return call.output
        overflow = self._engine.step(
            optimizer,
            inv_scale=1.0 / self.loss_scale,
            check_overflow=self.scaler is not None or policy != "ignore",
            before_update=before_update,
            update=update,
            step_kwargs=step_kwargs,
        )
        if update:
            self._after_step(overflow, step, policy)

    def _after_step(self, overflow: bool, step: int, policy: str) -> None:
        """The loss scale's update, or the non-finite policy, after a step that ran a backward."""
        if self.scaler is not None:
            self.scaler.update(overflow)
        elif overflow:
            self._nonfinite(step, policy)

    def _before_update(self, model: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """The user's ``on_before_optimizer_step`` hooks and clipping; with ``expose_param_grads``
        inside :meth:`ZeroEngine.full_gradients`, so they read (and edit) ``param.grad`` as under DDP
        (the parameters of the optimizer stepping; another optimizer's keep None)."""
        assert self._engine is not None
        if not self.exposes_step_grads(model):
            return self._after_closure(model, optimizer)
        with self._engine.full_gradients(model, 1.0 / self.loss_scale, optimizer=optimizer):
            self._after_closure(model, optimizer)

    def exposes_step_grads(self, model: pl.LightningModule) -> bool:
        """Whether ``on_before_optimizer_step`` and ``configure_gradient_clipping`` see ``param.grad``
        under automatic optimization: ``expose_param_grads=True``, or None (the default) where user code
        runs there (the LightningModule overrides either hook, or a callback overrides
        ``on_before_optimizer_step``): runs that read no gradient pay nothing."""
        assert self._engine is not None
        exposed = self._engine.config.zero.expose_param_grads
        if exposed is not None:
            return exposed
        return reads_step_grads(model)

    def _nonfinite(self, step: int, policy: str) -> None:
        """Non-finite gradients without loss scaling: the step was not applied (weights unchanged)."""
        self.nonfinite_steps += 1
        if policy == "error":
            raise FloatingPointError(
                f"non-finite gradients (inf or NaN) at optimizer step {step}: the step was not applied and the "
                "weights are unchanged. Look for a bad batch or a diverging loss; to skip such steps with a "
                "warning instead, pass ZeroStrategy(on_nonfinite='skip')."
            )
        rank_zero_warn(
            f"non-finite gradients at optimizer step {step}: step skipped, weights unchanged "
            f"({self.nonfinite_steps} skipped so far)."
        )

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip over the shards: the norm is global across ranks, as in DDP."""
        if clip_val <= 0 or self._engine is None:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        # Inside the step or before it (manual optimization): the engine exposes the window's reduced
        # gradients once, unscaled, so the clip applies to what the step will use, as under DDP.
        inv_scale = 1.0 / self.loss_scale
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._engine.clip_grad_value(optimizer, float(clip_val), inv_scale)
        else:
            self._engine.clip_grad_norm(optimizer, float(clip_val), inv_scale)

    # -- checkpoint ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Any:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
