"""The optimizer step with the compiled kernels of :mod:`lightning_zero.ops`, on flat fp32 slices.

Two cases use it instead of the user's ``optimizer.step()`` (which optimizer gets which kernel, and
with what hyperparameters: :mod:`~lightning_zero.zero.step_mapping`):

* **Offload** (``offload_optimizer``): the masters live in host memory and the user's Adam/AdamW
  (torch's, or ``ops.CPUAdam``/``ops.FusedAdam``) is mapped to ``ops.functional.cpu_adam_step`` with
  the same hyperparameters, read from each parameter group at every step (LR schedulers keep
  working). One pass per slice updates master and moments and writes the 16-bit copy of the
  parameters; that copy goes to the device without blocking the host.
* **LAMB on shards** (``ops.CPULamb``/``ops.FusedLamb``, offloaded or not): the trust ratio needs the
  norms of whole parameters, whose pieces are spread over ranks: two phases with one all-reduce of
  the per-parameter sums between them (:mod:`~lightning_zero.zero.step_lamb`, a mixin of
  :class:`KernelStep`).

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

from typing import Any

import torch

from lightning_zero import comm
from lightning_zero.offload.copy_back import CopyBack
from lightning_zero.offload.host import host_empty
from lightning_zero.offload.nvme import Swapped, SwapStore
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.publish import Stepped
from lightning_zero.zero.step_lamb import ShardedLamb
from lightning_zero.zero.step_mapping import (
    MOMENT_DTYPES,
    kernel_hyper,
    kernel_kind,
    lamb_family,
    one_state_hyper,
    one_state_kind,
)


class KernelStep(ShardedLamb):
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
        self.kind = "adam" if lamb else (one_state_kind(optimizer) or "adam")
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
        """The kernel step ``optimizer`` needs under ZeRO, or None when its own ``step()`` is right
        (:func:`~lightning_zero.zero.step_mapping.kernel_kind`). ``group_of``: ``id(buffer) ->
        parameter group`` (default: each buffer's ``optimizer_group``)."""
        kind = kernel_kind(optimizer, buffers)
        if kind is None:
            return None
        return KernelStep(optimizer, buffers, group, lamb=kind == "lamb", group_of=group_of)

    @staticmethod
    def moment_itemsize(optimizer: torch.optim.Optimizer) -> int:
        """Bytes per element of each moment the kernel step keeps for masters in host memory (what
        :meth:`_moment_dtype` decides, before any step): 2 for ``state_dtype=torch.bfloat16`` on an
        Adam-kind or Lion optimizer, else 4."""
        dtype = getattr(optimizer, "state_dtype", torch.float32)
        lamb, kind = isinstance(optimizer, lamb_family()), one_state_kind(optimizer)
        return 4 if lamb or kind == "adagrad" or dtype not in MOMENT_DTYPES else dtype.itemsize

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

    def staging(self) -> list[torch.Tensor]:
        """The host staging copies :meth:`_param_copy` keeps (one per offloaded 16-bit buffer)."""
        return list(self._copy_out.values())

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
            hyper = kernel_hyper(self.optimizer, self.optimizer.param_groups[self.group_of[id(b)]])
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
            hyper = one_state_hyper(self.kind, param_group)
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
