"""Step 4 of the data path, **step**: the user's optimizer on this rank's slices only.

The optimizer the LightningModule returned is kept (its class, hyperparameters, parameter groups,
and identity, so LR schedulers and ``self.optimizers()`` keep working), but each parameter group's
``params`` is rewired to the fp32 ``master`` slices of the flat buffers of that group. Its ``state``
therefore holds optimizer states for this rank's slice only: 12/N bytes per parameter for Adam.

This is exact only for elementwise optimizers, whose update of an element reads that element
alone: slices cut through parameters. Optimizers built on whole-tensor statistics (LAMB's trust
ratio, Adafactor's factored moments, LBFGS) are rejected.

Checkpoints use the *consolidated* format: exactly what ``optimizer.state_dict()`` of the same
optimizer would return without ZeRO (state per original parameter, full shapes), plus the fp32
master weights under ``"master"`` when they are separate from the parameters. A plain (DDP)
checkpoint therefore loads into a ZeRO run and back.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.step_kernels import KernelStep

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


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool) -> None:
    """Raise ``ValueError`` unless ``optimizer`` can step flat slices exactly."""
    from lightning_zero import ops

    cls = type(optimizer)
    if cls in ELEMENTWISE_OPTIMIZERS or cls in (ops.CPUAdam, ops.FusedAdam):
        return
    if cls in (ops.CPULamb, ops.FusedLamb):
        return  # stepped by the shard-aware LAMB kernels (lightning_zero.zero.step_kernels)
    name = cls.__name__
    if any(hint in name.lower() for hint in _WHOLE_TENSOR_HINTS):
        raise ValueError(
            f"{name} computes its update from whole-tensor statistics (norms or factored moments), but ZeRO "
            "steps contiguous slices of flat buffers that cut through parameters, so its updates would be wrong. "
            "Use an elementwise optimizer (SGD, Adam, AdamW, ...), or for LAMB the shard-aware "
            "lightning_zero.ops.CPULamb / FusedLamb."
        )
    if not allow_untested:
        raise ValueError(
            f"{name} is not known to be elementwise. ZeRO steps slices of parameters, which is exact only when "
            "each element's update depends on that element alone. If that holds for your optimizer, pass "
            "ZeroStrategy(allow_untested_optimizer=True); otherwise use SGD, Adam, AdamW or another "
            "torch.optim elementwise optimizer."
        )


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    # vector_norm accumulates in fp32 without materializing an fp32 (or squared) copy of the slice
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()


class ShardedOptimizer:
    """The user's optimizer rewired to this rank's master slices; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, buffers: list[FlatBuffer], group: comm.ProcessGroup) -> None:
        if any(len(state) for state in optimizer.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__} already has optimizer state before ZeRO set it up; create it in "
                "configure_optimizers and do not step it before training starts."
            )
        self.optimizer = optimizer
        self.buffers = buffers
        self.group = group
        self.rank = comm.rank(group)
        # Set by a tensor-parallel strategy: parameters marked ``tensor_parallel`` hold different
        # shards on its ranks; the others are replicas, counted on tensor-parallel rank 0 only.
        self.tensor_parallel_group: comm.ProcessGroup = None
        # Set under pipeline parallelism: every stage holds other parameters (norms add up over the
        # pipeline group), and a parameter tied across stages is counted on its first stage only.
        self.pipeline_parallel_group: comm.ProcessGroup = None
        self.counted_elsewhere: set[int] = set()  # ids of parameters whose norm another stage counts
        self.original_params = [list(g["params"]) for g in optimizer.param_groups]
        for g_index, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [b.master for b in buffers if b.optimizer_group == g_index]
        optimizer.state.clear()
        self.kernel = KernelStep.for_optimizer(optimizer, buffers, group)

    # -- gradients ----------------------------------------------------------------------------

    def prepare(self, inv_scale: float) -> None:
        """Expose the reduced slices as ``master.grad`` (fp32, unscaled by ``inv_scale``)."""
        for b in self.buffers:
            if b.host_grad is not None and b.host_grad_current:
                grad = b.host_grad.float()  # copied during backward (the engine waited for it)
            elif b.offloaded:
                grad = b.grad_shard.to(device="cpu", dtype=torch.float32)  # to the host master
            else:
                grad = b.grad_shard.float() if b.separate_master else b.grad_shard
            if inv_scale != 1.0:
                grad.mul_(inv_scale)
            b.master.grad = grad

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over all ranks' slices (fp32 scalar; padding is zero), replicas of the
        tensor-parallel group and copies of pipeline-tied parameters counted once. Call on all ranks."""
        device = self.buffers[0].master.device if self.buffers else torch.device("cpu")
        local = torch.zeros((), dtype=torch.float32, device=device)
        tp, pp = self.tensor_parallel_group, self.pipeline_parallel_group
        replicas_counted = tp is None or comm.rank(tp) == 0  # (None is not "the default group" here)
        for b in self.buffers:
            grad = b.master.grad
            if grad is None:
                continue
            if replicas_counted and not self.counted_elsewhere:
                local += _squared_norm(grad)
                continue
            for piece in b.shards:
                param = b.params[piece.param_index]
                if id(param) in self.counted_elsewhere:
                    continue
                if replicas_counted or getattr(param, "tensor_parallel", False):
                    local += _squared_norm(grad[piece.shard_offset : piece.shard_offset + piece.numel])
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
        for b in self.buffers:
            if b.master.grad is not None:
                b.master.grad.mul_(coef.to(b.master.grad.dtype))
        return norm

    def clip_grad_value(self, clip_value: float) -> None:
        for b in self.buffers:
            if b.master.grad is not None:
                b.master.grad.clamp_(-clip_value, clip_value)

    def step(self) -> None:
        """Update the master slices and write them into the parameter slices (the kernels do both in
        one pass; after torch's step the cast copy is a second one)."""
        if self.kernel is not None:
            self.kernel.step(self.tensor_parallel_group)
            return
        self.optimizer.step()
        for b in self.buffers:
            b.params_from_master()

    def release_grads(self) -> None:
        for b in self.buffers:
            b.master.grad = None

    # -- checkpoints (consolidated format) ------------------------------------------------------

    def _original_index(self) -> dict[int, int]:
        ids = [id(p) for group in self.original_params for p in group]
        return {pid: i for i, pid in enumerate(ids)}

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The unsharded ``state_dict`` on group rank 0 (``{}`` on other ranks). Call on all ranks."""
        index = self._original_index()
        state: dict[int, dict[str, Any]] = {}
        for b in self.buffers:
            shard_state = dict(self.optimizer.state.get(b.master, {}))
            if b.separate_master:
                shard_state["master"] = b.master
            for key in sorted(shard_state):
                value = shard_state[key]
                is_slice = torch.is_tensor(value) and value.shape == b.master.shape
                full = None
                if is_slice:
                    full = torch.empty(b.layout.padded_numel, dtype=value.dtype, device=value.device)
                    comm.all_gather(full, value.contiguous(), self.group)
                if self.rank != 0:
                    continue
                for param, slot in zip(b.params, b.layout.slots, strict=True):
                    entry = state.setdefault(index[id(param)], {})
                    if is_slice:
                        entry[key] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).cpu().clone()
                    else:
                        entry[key] = value.cpu().clone() if torch.is_tensor(value) else value
        if self.rank != 0:
            return {}
        groups = []
        for g_index, saved in enumerate(self.optimizer.state_dict()["param_groups"]):
            group = {k: v for k, v in saved.items() if k != "params"}
            group["params"] = [index[id(p)] for p in self.original_params[g_index]]
            groups.append(group)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded optimizer ``state_dict`` (ours or a plain one); every rank keeps its slice."""
        saved_groups = state_dict["param_groups"]
        sizes = [len(g) for g in self.original_params]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(
                f"the checkpoint's optimizer has parameter groups of sizes {saved_sizes} but "
                f"{type(self.optimizer).__name__} here has {sizes}; load it into the same model and "
                "configure_optimizers that wrote it."
            )
        saved_ids = [i for g in saved_groups for i in g["params"]]
        by_position = {pos: saved_ids[pos] for pos in range(len(saved_ids))}
        position = self._original_index()
        full_state = state_dict["state"]
        new_state: dict[int, dict[str, Any]] = {}
        # load_state_dict keys are positions in the optimizer's parameter order (group by group),
        # which under stage 3 is not the order of self.buffers.
        slot = {id(m): i for i, m in enumerate(m for g in self.optimizer.param_groups for m in g["params"])}
        for b in self.buffers:
            entries = [full_state.get(by_position[position[id(p)]], {}) for p in b.params]
            shard_state = self._slice_state(b, entries)
            master = shard_state.pop("master", None)
            if master is not None and b.separate_master:
                b.master.copy_(master)
            if shard_state:
                new_state[slot[id(b.master)]] = shard_state
        groups, k = [], 0
        for g_index, saved in enumerate(saved_groups):
            group = {key: v for key, v in saved.items() if key != "params"}
            count = len(self.optimizer.param_groups[g_index]["params"])
            group["params"] = list(range(k, k + count))
            k += count
            groups.append(group)
        self.optimizer.load_state_dict({"state": new_state, "param_groups": groups})

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
