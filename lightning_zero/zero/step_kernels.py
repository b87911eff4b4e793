"""The optimizer step with the compiled kernels of :mod:`lightning_zero.ops`, on flat fp32 slices.

Two cases use it instead of the user's ``optimizer.step()``:

* **Offload** (``offload_optimizer``): the masters live in host memory and the user's Adam/AdamW
  (torch's, or ``ops.CPUAdam``/``ops.FusedAdam``) is mapped to ``ops.functional.cpu_adam_step`` with
  the same hyperparameters, read from each parameter group at every step (LR schedulers keep
  working). One pass per slice updates master and moments and writes the 16-bit copy of the
  parameters; that copy goes to the device without blocking the host.
* **LAMB on shards** (``ops.CPULamb``/``ops.FusedLamb``, offloaded or not): the trust ratio needs the
  norms of whole parameters, whose pieces are spread over ranks. Phase 1 returns squared norms per
  piece; pieces are summed per parameter within the rank and then across ranks (one all-reduce per
  step); phase 2 applies each parameter's ratio. Under tensor parallelism a parameter marked
  ``tensor_parallel`` is itself a shard of a larger one, whose norms also add up over the
  tensor-parallel group (a second all-reduce of the same small table), as the global gradient norm
  of :mod:`lightning_zero.zero.step` does; replicated parameters keep tensor-parallel rank 0's
  sums, so every rank applies the same ratio to its replica.

**Pipelined** (``OffloadConfig.pipeline``, the default; DeepSpeed's pipelined offload): ``step`` is
given a ``stepped`` callback (the engine's :class:`~lightning_zero.zero.publish.Publisher`) called
with each flat buffer (a bucket under stages 1/2, a sub-group) as soon as its update and 16-bit
copy-back are issued, so that buffer's all-gather (and on a GPU its host-to-device copy, on a side
stream: :mod:`lightning_zero.offload.copy_back`) runs while the next buffer is stepped. Each buffer's
arithmetic is the same as unpipelined, so the results are bitwise equal.

With ``offload_optimizer="nvme"`` the masters and moments of each flat buffer (a sub-group) live in
swap files (:mod:`lightning_zero.offload.nvme`) between steps: the step reads the next
``buffer_count - 1`` sub-groups ahead while the current one steps (with each one's gradient slice,
which rests on disk too at stages 2/3: :mod:`lightning_zero.zero.swap_grads`; a bf16 slice goes to
the kernel as it is), and writes each one behind, freeing it once ``buffer_count - 1`` later ones
are stepped (reads and writes both in flight all through the phase); with ``offload_parameters="nvme"`` each buffer's new 16-bit parameter shard is written behind too
(:class:`lightning_zero.zero.swap.ParamTier`).

States live in ``optimizer.state[master]`` under torch's Adam keys (``step``, ``exp_avg``,
``exp_avg_sq``), so checkpoints look the same with and without offload and load into each other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from lightning_zero import comm
from lightning_zero.offload.copy_back import CopyBack
from lightning_zero.offload.host import host_empty
from lightning_zero.offload.nvme import Swapped, SwapStore
from lightning_zero.zero.flat import FlatBuffer

#: called with each buffer once its step and copy-back are issued, and the event that copy recorded
Stepped = Callable[[FlatBuffer, "torch.cuda.Event | None"], None]


def _adam_family() -> tuple[type, ...]:
    from lightning_zero import ops

    return (torch.optim.Adam, torch.optim.AdamW, ops.CPUAdam, ops.FusedAdam)


#: moment dtypes the CPU kernels store (``state_dtype`` of lightning_zero's optimizers)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)

#: the classes whose own ``step`` the kernels replace
_KERNEL_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def _step_replaced(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the class's ``step`` is no longer torch's (patched or wrapped on the class, e.g. by
    instrumentation or ``mock.patch("torch.optim.Adam.step")``): then that ``step`` runs, as under
    DDP, instead of a kernel that would bypass it. Decided by what the step is now (torch's function
    of that class, under torch's own wrappers), not against a copy taken at import: a patch made
    before this package was imported would be that copy."""
    cls = type(optimizer)
    if cls not in _KERNEL_CLASSES:
        return False
    step = inspect.unwrap(cls.step)
    torch_steps = {(k.__module__, f"{k.__name__}.step") for k in cls.__mro__ if k.__module__.startswith("torch.optim")}
    return not (inspect.isfunction(step) and (step.__module__, step.__qualname__) in torch_steps)


def _one_state_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """ "adagrad" for exactly torch.optim.Adagrad, "lion" for exactly ops.Lion, else None."""
    from lightning_zero import ops

    return {torch.optim.Adagrad: "adagrad", ops.Lion: "lion"}.get(type(optimizer))


def _lamb_family() -> tuple[type, ...]:
    from lightning_zero import ops

    return (ops.CPULamb, ops.FusedLamb)


def _hyper(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """Kernel hyperparameters of one parameter group (read live: schedulers change ``lr``)."""
    beta1, beta2 = group["betas"]
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError(
            f"{type(optimizer).__name__}(amsgrad={group.get('amsgrad')}, maximize={group.get('maximize')}) has no "
            "offloaded CPU kernel; use amsgrad=False and maximize=False, or offload_optimizer=False."
        )
    adamw = group.get(
        "adamw_mode", isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
    )
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "adamw_mode": bool(adamw),
        "bias_correction": bool(group.get("bias_correction", True)),
    }


def _one_state_hyper(kind: str, group: dict[str, Any]) -> dict[str, Any]:
    """Kernel hyperparameters of one Adagrad or Lion parameter group (read live, as for Adam)."""
    if kind == "adagrad":
        keys = ("lr", "lr_decay", "eps", "weight_decay")
        return {k: float(group[k]) for k in keys}
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "weight_decay": float(group["weight_decay"]),
    }


class KernelStep:
    """Steps one rewired optimizer's master slices with the ops kernels (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buffers: list[FlatBuffer],
        group: comm.ProcessGroup,
        lamb: bool,
        group_of: dict[int, int] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.buffers = buffers
        #: ``id(buffer) -> this optimizer's parameter group`` (a shared buffer joins a group of each holder)
        self.group_of = (
            group_of
            if group_of is not None
            else {id(b): b.optimizer_group for b in buffers if b.optimizer_group is not None}
        )
        self.group = group
        self.lamb = lamb
        #: the disk tier holding masters and moments between steps (``offload_optimizer="nvme"``)
        self.swap: SwapStore | None = None
        #: "adam", or "adagrad"/"lion": the one-state kernels (functional.cpu_adagrad_step/cpu_lion_step)
        self.kind = "adam" if lamb else (_one_state_kind(optimizer) or "adam")
        self._copy_out: dict[int, torch.Tensor] = {}
        self.copy_back = CopyBack()
        #: the optimizer's part of its swap file names (EngineSwap sets ``opt<o>.``)
        self.swap_prefix = ""
        #: LAMB with masters on a GPU: the multi-tensor kernels over one view per segment (the CPU
        #: kernels take segment offsets instead). Either computes the same numbers.
        self.fused = any(b.master.device.type != "cpu" for b in buffers)
        if lamb:
            self._plan_lamb()

    @staticmethod
    def for_optimizer(
        optimizer: torch.optim.Optimizer,
        buffers: list[FlatBuffer],
        group: comm.ProcessGroup,
        group_of: dict[int, int] | None = None,
    ) -> KernelStep | None:
        """The kernel step ``optimizer`` needs under ZeRO, or None when its own ``step()`` is right.
        ``group_of``: ``id(buffer) -> parameter group`` (default: each buffer's ``optimizer_group``)."""
        if isinstance(optimizer, _lamb_family()):
            return KernelStep(optimizer, buffers, group, lamb=True, group_of=group_of)
        if any(b.master.dtype == torch.float64 for b in buffers):
            return None  # the compiled Adam kernels step fp32 masters; torch's step takes float64 ones
        if not any(b.offloaded for b in buffers):
            return KernelStep._for_host_masters(optimizer, buffers, group, group_of)
        # Offloaded: the compiled kernel for exactly Adam/AdamW, Adagrad or ops.Lion (a subclass may
        # add to step(), so it steps itself), else the user's optimizer runs its own step() on the host masters, as
        # DeepSpeed does with zero_force_ds_cpu_optimizer=False.
        if _step_replaced(optimizer):
            return None
        if _one_state_kind(optimizer) is not None:
            if any(g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
                return None
            return KernelStep(optimizer, buffers, group, lamb=False, group_of=group_of)
        if type(optimizer) not in _adam_family() or any(
            g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups
        ):
            return None
        for param_group in optimizer.param_groups:
            _hyper(optimizer, param_group)  # reject amsgrad/maximize before training starts
        return KernelStep(optimizer, buffers, group, lamb=False, group_of=group_of)

    @staticmethod
    def _for_host_masters(
        optimizer: torch.optim.Optimizer,
        buffers: list[FlatBuffer],
        group: comm.ProcessGroup,
        group_of: dict[int, int] | None,
    ) -> KernelStep | None:
        """Without offload, torch's Adam/AdamW on fp32 masters in host memory (CPU training) also runs
        the compiled kernel: one pass instead of torch's several over the slice (measured ~50 ms ->
        ~15 ms per step on a 14M-parameter GPT, 2 ranks), and it writes the 16-bit parameters in the
        same pass. Only when the kernel is compiled (the readable fallback is slower than torch)."""
        from lightning_zero.ops import compiled

        if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not compiled() or not buffers:
            return None
        if _step_replaced(optimizer):
            return None
        if any(b.master.device.type != "cpu" or b.master.dtype != torch.float32 for b in buffers):
            return None
        if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
            return None
        return KernelStep(optimizer, buffers, group, lamb=False, group_of=group_of)

    @staticmethod
    def moment_itemsize(optimizer: torch.optim.Optimizer) -> int:
        """Bytes per element of each moment the kernel step keeps for masters in host memory (what
        :meth:`_moment_dtype` decides, before any step): 2 for ``state_dtype=torch.bfloat16`` on an
        Adam-kind or Lion optimizer, else 4."""
        dtype = getattr(optimizer, "state_dtype", torch.float32)
        lamb, kind = isinstance(optimizer, _lamb_family()), _one_state_kind(optimizer)
        return 4 if lamb or kind == "adagrad" or dtype not in _MOMENT_DTYPES else dtype.itemsize

    # -- per step ----------------------------------------------------------------------------------

    def _moment_dtype(self, master: torch.Tensor) -> torch.dtype:
        """The dtype of the moments: the optimizer's ``state_dtype`` (``ops.CPUAdam`` / ``FusedAdam`` /
        ``Lion`` with ``state_dtype=torch.bfloat16``: half the bytes of the states in memory, on disk
        under the NVMe tier and through the step, which reads and writes them) where the CPU kernels
        step these masters (they widen bf16 moments to fp32 and round them back, nearest even, as the
        optimizer itself does); fp32 otherwise (torch's optimizers, LAMB, masters on a GPU)."""
        if master.device.type != "cpu" or KernelStep.moment_itemsize(self.optimizer) == 4:
            return torch.float32
        return torch.bfloat16

    def _state(self, master: torch.Tensor) -> dict[str, Any]:
        state = self.optimizer.state[master]
        if not state and self.kind != "adam":
            # torch.optim.Adagrad's keys ("step", "sum" from initial_accumulator_value); Lion's "exp_avg"
            if self.kind == "adagrad":
                state["step"] = torch.tensor(0.0)
                init = float(self.optimizer.param_groups[0].get("initial_accumulator_value", 0.0))
                state["sum"] = torch.full_like(master, init)
            else:
                state["exp_avg"] = torch.zeros_like(master, dtype=self._moment_dtype(master))
        elif not state:
            dtype = self._moment_dtype(master)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(master, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(master, dtype=dtype)
        elif self.swap is None and self.kind in ("adam", "lion"):
            # torch's load_state_dict casts loaded states to the parameter's dtype (fp32): back to
            # the optimizer's moment dtype, once (exact for moments saved in bf16). Under the disk
            # tier the files hold what was loaded, and a resumed run keeps fp32 moments.
            dtype = self._moment_dtype(master)
            for key in ("exp_avg", "exp_avg_sq"):
                value = state.get(key)
                if torch.is_tensor(value) and value.dtype != dtype and value.shape == master.shape:
                    state[key] = value.to(dtype)
        return state

    def _param_copy(self, b: FlatBuffer) -> torch.Tensor | None:
        """Where the kernel writes the updated 16-bit parameters: the device slice itself when it is
        in host memory, else a (pinned) host staging buffer copied to the device afterwards."""
        if b.param_shard.dtype == torch.float32 or b.master.device.type != "cpu":
            return None
        if b.param_shard.device.type == "cpu":
            return b.param_shard
        if id(b) not in self._copy_out:
            self._copy_out[id(b)] = host_empty(b.layout.shard_numel, b.param_shard.dtype)
        return self._copy_out[id(b)]

    def _write_back(self, b: FlatBuffer, copy: torch.Tensor | None, stepped: Stepped | None) -> None:
        """The updated 16-bit slice into ``b.param_shard``; pipelined, then ``stepped(b, event)``."""
        ready = None
        if copy is not None and copy.data_ptr() == b.param_shard.data_ptr():
            pass  # the kernel wrote the parameter slice itself
        elif not b.offloaded:
            b.params_from_master()
        else:
            source = b.master if copy is None else copy
            if source.data_ptr() == b.param_shard.data_ptr():
                pass
            elif stepped is not None:
                ready = self.copy_back.copy(b.param_shard, source)  # side stream: overlaps the next step
            else:
                # non_blocking: from pinned memory the host does not wait for the transfer
                b.param_shard.copy_(source, non_blocking=True)
        if stepped is not None:
            stepped(b, ready)

    def _before_kernel(self, b: FlatBuffer, copy: torch.Tensor | None) -> None:
        """Pipelined on a GPU: the host waits for last step's copy out of the tensors it now rewrites."""
        self.copy_back.before_write(b.master)
        if copy is not None:
            self.copy_back.before_write(copy)

    def swap_name(self, index: int, key: str) -> str:
        """The swap file name of ``self.buffers[index]``'s ``key`` ("master", "exp_avg", ...):
        ``opt<o>.<index>.<key>``, ``o`` being this optimizer's position in the engine
        (``swap_prefix``, set by the disk tier), so two optimizers' files never share a name (the
        store's directory is unique per process, rank and engine: :mod:`lightning_zero.offload.nvme`)."""
        return f"{self.swap_prefix}{index}.{key}"

    def swapped(self, index: int) -> list[Swapped]:
        """The tensors of ``self.buffers[index]`` that the disk tier holds: master and moments."""
        master = self.buffers[index].master
        state = self.optimizer.state.get(master, {})
        return [(self.swap_name(index, "master"), master)] + [
            (self.swap_name(index, key), state[key]) for key in ("exp_avg", "exp_avg_sq") if key in state
        ]

    def step(self, tensor_parallel_group: comm.ProcessGroup = None, stepped: Stepped | None = None) -> None:
        """One optimizer step on every buffer. ``tensor_parallel_group``: the group over which
        parameters marked ``tensor_parallel`` are split (``None``: no tensor parallelism; LAMB only).
        ``stepped``: pipelined, called with each buffer (in the same order on every rank) once its
        step and copy-back are issued. Call on all ranks."""
        if self.lamb:
            self._lamb_step(tensor_parallel_group, stepped)
        elif self.kind != "adam":
            self._one_state_step(stepped)
        else:
            self._adam_step(stepped)
        if stepped is not None:
            self.copy_back.end()
        # torch's LR schedulers warn unless they saw optimizer.step() run; this was the step.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's "optimizer stepped" flag for LR schedulers

    def _adam_step(self, stepped: Stepped | None) -> None:
        from lightning_zero.ops import functional as F

        order = [
            (index, b)
            for g_index in range(len(self.optimizer.param_groups))
            for index, b in enumerate(self.buffers)
            if self.group_of[id(b)] == g_index and (b.master.grad is not None or b.pending_grad is not None)
        ]
        swap, ahead = self.swap, 0 if self.swap is None else self.swap.config.buffer_count - 1
        if swap is not None:
            for index, _ in order[:ahead]:
                swap.fetch(self._step_items(index))
        for position, (index, b) in enumerate(order):
            if swap is not None:
                swap.fetch(self._step_items(index))  # (a no-op when read ahead)
                swap.wait(self._step_items(index))
                if position + ahead < len(order):
                    swap.fetch(self._step_items(order[position + ahead][0]))  # read ahead while this one steps
            # only buffers of this optimizer with a gradient this step are in order
            on_disk = b.grad_tier if b.pending_grad is not None else None  # the gradient rests on disk
            # a bf16 slice on disk goes to the kernel as it is (no fp32 copy; swap_grads.py)
            direct = on_disk.kernel_grad(b) if on_disk is not None else None
            grad, grad_scale = direct if direct is not None else (None, 1.0)
            if grad is None:
                grad = b.master.grad if on_disk is None else on_disk.step_grad(b)
            assert grad is not None
            hyper = _hyper(self.optimizer, self.optimizer.param_groups[self.group_of[id(b)]])
            state = self._state(b.master)
            state["step"] += 1
            if b.shard_tier is not None:
                b.shard_tier.open_for_write(b)  # the parameter disk tier: memory for the 16-bit copy
            copy = self._param_copy(b)
            self._before_kernel(b, copy)
            F.cpu_adam_step(
                b.master,
                grad.contiguous(),
                state["exp_avg"],
                state["exp_avg_sq"],
                step=int(state["step"]),
                param_copy=copy,
                grad_scale=grad_scale,
                **hyper,
            )
            if on_disk is not None:
                del grad
                on_disk.done_step(b)  # the slice's memory (its file is stale now)
            self._write_back(b, copy, stepped)
            if b.shard_tier is not None:
                b.shard_tier.write_behind(b)
            if swap is not None:
                # written behind, as deep as reads go ahead (at least one): freed once that many
                # later sub-groups are stepped, so reads and writes both keep the disk busy
                swap.evict(self.swapped(index))
                if position >= max(ahead, 1):
                    self._release(swap, order[position - max(ahead, 1)][0])
        if swap is not None:
            for index, _ in order[max(0, len(order) - max(ahead, 1)) :]:
                self._release(swap, index)
        for tier in {id(t): t for t in (b.shard_tier for _, b in order) if t is not None}.values():
            tier.flush()

    def _step_items(self, index: int) -> list[Swapped]:
        """What the step reads for ``self.buffers[index]``: master and moments, and its gradient when
        that rests on the disk tier too (:mod:`lightning_zero.zero.swap_grads`)."""
        b = self.buffers[index]
        grads = b.grad_tier.step_items(b) if b.grad_tier is not None else []
        return self.swapped(index) + grads

    def _release(self, swap: SwapStore, index: int) -> None:
        # a pipelined copy-back from an fp32 master may still read it: done before its memory goes
        self.copy_back.before_write(self.buffers[index].master)
        swap.release(self.swapped(index))

    def _one_state_step(self, stepped: Stepped | None) -> None:
        """Adagrad or Lion: one compiled pass per master slice (grad, state, param, 16-bit copy)."""
        from lightning_zero.ops import functional as F

        for g_index, param_group in enumerate(self.optimizer.param_groups):
            hyper = _one_state_hyper(self.kind, param_group)
            for b in self.buffers:
                if self.group_of[id(b)] != g_index or b.master.grad is None:
                    continue
                state = self._state(b.master)
                copy = self._param_copy(b)
                self._before_kernel(b, copy)
                grad = b.master.grad.contiguous()
                if self.kind == "adagrad":
                    state["step"] += 1
                    F.cpu_adagrad_step(b.master, grad, state["sum"], step=int(state["step"]), param_copy=copy, **hyper)
                else:
                    F.cpu_lion_step(b.master, grad, state["exp_avg"], param_copy=copy, **hyper)
                self._write_back(b, copy, stepped)

    # -- LAMB on shards ---------------------------------------------------------------------------

    def _plan_lamb(self) -> None:
        """Segments of every master slice (one per parameter piece, plus the padding) and the index
        of the parameter each belongs to, numbered over the whole optimizer."""
        ids: dict[int, int] = {}
        split: list[bool] = []
        for b in self.buffers:
            for p in b.params:
                if id(p) not in ids:
                    ids[id(p)] = len(ids)
                    split.append(bool(getattr(p, "tensor_parallel", False)))
        self.num_params = len(ids)
        #: (num_params + 1,) True for the shards of tensor-parallel parameters (the padding row: False)
        self.tensor_parallel_rows = torch.tensor(split + [False], dtype=torch.bool)
        self.segments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for b in self.buffers:
            offsets, owners = [0], []
            for piece in b.shards:
                offsets.append(piece.shard_offset + piece.numel)
                owners.append(ids[id(b.params[piece.param_index])])
            if offsets[-1] < b.layout.shard_numel:  # padding: zero, never updated meaningfully
                offsets.append(b.layout.shard_numel)
                owners.append(self.num_params)
            self.segments[id(b)] = (torch.tensor(offsets, dtype=torch.long), torch.tensor(owners, dtype=torch.long))

    def _segments(self, b: FlatBuffer, tensor: torch.Tensor) -> list[torch.Tensor]:
        offsets = self.segments[id(b)][0].tolist()
        return [tensor[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:], strict=False)]

    def _lamb_moments(self, b: FlatBuffer, state: dict[str, Any], step: int, hyper: dict[str, Any]) -> torch.Tensor:
        from lightning_zero.ops import functional as F

        phase1 = {k: v for k, v in hyper.items() if k != "lr"}
        assert b.master.grad is not None  # only buffers with a gradient this step get here
        grad = b.master.grad.contiguous()
        if self.fused:
            views = [self._segments(b, t) for t in (b.master, grad, state["exp_avg"], state["exp_avg_sq"])]
            return F.fused_lamb_moments(*views, step=step, **phase1)
        offsets = self.segments[id(b)][0]
        return F.cpu_lamb_moments(b.master, grad, state["exp_avg"], state["exp_avg_sq"], offsets, step=step, **phase1)

    def _lamb_apply(
        self,
        b: FlatBuffer,
        state: dict[str, Any],
        ratio: torch.Tensor,
        step: int,
        hyper: dict[str, Any],
        stepped: Stepped | None,
    ) -> None:
        from lightning_zero.ops import functional as F

        offsets, owners = self.segments[id(b)]
        if self.fused:
            params, exp_avgs, exp_avg_sqs = (
                self._segments(b, t) for t in (b.master, state["exp_avg"], state["exp_avg_sq"])
            )
            direct = b.separate_master and not b.offloaded and b.param_shard.device == b.master.device
            copies = self._segments(b, b.param_shard) if direct else []
            trust = ratio[owners.to(ratio.device)].contiguous()
            F.fused_lamb_apply(params, exp_avgs, exp_avg_sqs, trust, step=step, param_copies=copies, **hyper)
            if not direct:
                self._write_back(b, None, stepped)
            elif stepped is not None:
                stepped(b, None)  # written on the masters' device, in stream order
            return
        copy = self._param_copy(b)
        self._before_kernel(b, copy)
        F.cpu_lamb_apply(
            b.master,
            state["exp_avg"],
            state["exp_avg_sq"],
            offsets,
            ratio[owners].contiguous(),
            step=step,
            param_copy=copy,
            **hyper,
        )
        self._write_back(b, copy, stepped)

    def _whole_norms(self, sums: torch.Tensor, tensor_parallel_group: comm.ProcessGroup) -> torch.Tensor:
        """Per-parameter squared norms (num_params + 1, 2) of this rank's pieces -> of whole parameters."""
        # Reduced where the collectives run (NCCL reduces device tensors only).
        on_comm = sums.to(self.buffers[0].device) if self.buffers else sums
        comm.all_reduce(on_comm, self.group)  # pieces of a parameter on the data-parallel ranks
        if tensor_parallel_group is not None:
            # Shards of a tensor-parallel parameter add up over the group; replicas (equal on every
            # rank) are zeroed off rank 0, so the same sum leaves every rank with rank 0's numbers.
            keep = self.tensor_parallel_rows.to(on_comm.device) | (comm.rank(tensor_parallel_group) == 0)
            on_comm.mul_(keep.unsqueeze(-1))
            comm.all_reduce(on_comm, tensor_parallel_group)
        return on_comm

    def _lamb_step(self, tensor_parallel_group: comm.ProcessGroup, stepped: Stepped | None) -> None:
        from lightning_zero.ops import functional as F

        live = [b for b in self.buffers if b.master.grad is not None]
        device = live[0].master.device if live else torch.device("cpu")
        sums = torch.zeros(self.num_params + 1, 2, dtype=torch.float32, device=device)
        hypers, steps = {}, {}
        for b in live:
            hyper = _hyper(self.optimizer, self.optimizer.param_groups[self.group_of[id(b)]])
            hyper.pop("adamw_mode")
            state = self._state(b.master)
            state["step"] += 1
            hypers[id(b)], steps[id(b)] = hyper, int(state["step"])
            owners = self.segments[id(b)][1].to(device)
            sums.index_add_(0, owners, self._lamb_moments(b, state, steps[id(b)], hyper).to(device))
        ratio = F.lamb_trust_ratio(self._whole_norms(sums, tensor_parallel_group)).to(device)
        for b in live:
            self._lamb_apply(b, self.optimizer.state[b.master], ratio, steps[id(b)], hypers[id(b)], stepped)
