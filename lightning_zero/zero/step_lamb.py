"""LAMB on shards, a mixin of :class:`~lightning_zero.zero.step_kernels.KernelStep`
(``ops.CPULamb``/``ops.FusedLamb``, offloaded or not).

The trust ratio needs the norms of whole parameters, whose pieces are spread over ranks. Phase 1
returns squared norms per piece; pieces are summed per parameter within the rank and then across
ranks (one all-reduce per step); phase 2 applies each parameter's ratio. Under tensor parallelism a
parameter marked ``tensor_parallel`` is itself a shard of a larger one, whose norms also add up over
the tensor-parallel group (a second all-reduce of the same small table), as the global gradient norm
of :mod:`lightning_zero.zero.step` does; replicated parameters keep tensor-parallel rank 0's sums, so
every rank applies the same ratio to its replica.

The pieces are segments of each master slice (one per parameter piece, plus the padding), planned
once (:meth:`ShardedLamb._plan_lamb`); with masters on a GPU the multi-tensor kernels take one view
per segment, the CPU kernels the segment offsets. Either computes the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.publish import Stepped
from lightning_zero.zero.step_mapping import kernel_hyper


class ShardedLamb:
    """The LAMB step of a :class:`~lightning_zero.zero.step_kernels.KernelStep` (see the module
    docstring); the kernel step owns the optimizer, buffers and the 16-bit copy-back it uses."""

    optimizer: torch.optim.Optimizer
    buffers: list[FlatBuffer]
    group: comm.ProcessGroup
    group_of: dict[int, int]
    fused: bool

    if TYPE_CHECKING:
        # The kernel step's (declared for the type checker only: a stub here would be found before
        # the real method in any class that lists this mixin before the one that defines it).
        def _state(self, master: torch.Tensor) -> dict[str, Any]: ...
        def _param_copy(self, b: FlatBuffer) -> torch.Tensor | None: ...
        def _before_kernel(self, b: FlatBuffer, copy: torch.Tensor | None) -> None: ...
        def _write_back(self, b: FlatBuffer, copy: torch.Tensor | None, stepped: Stepped | None) -> None: ...

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
            hyper = kernel_hyper(self.optimizer, self.optimizer.param_groups[self.group_of[id(b)]])
            hyper.pop("adamw_mode")
            state = self._state(b.master)
            state["step"] += 1
            hypers[id(b)], steps[id(b)] = hyper, int(state["step"])
            owners = self.segments[id(b)][1].to(device)
            sums.index_add_(0, owners, self._lamb_moments(b, state, steps[id(b)], hyper).to(device))
        ratio = F.lamb_trust_ratio(self._whole_norms(sums, tensor_parallel_group)).to(device)
        for b in live:
            self._lamb_apply(b, self.optimizer.state[b.master], ratio, steps[id(b)], hypers[id(b)], stepped)
