"""Step 4 for whole-tensor optimizers: partition by parameter instead of by flat slice.

Muon orthogonalizes a whole matrix, Adafactor factors its second moment over rows and columns, a
Shampoo-style preconditioner multiplies by matrices built from the whole gradient: the update of an
element reads other elements of the same tensor, so the contiguous slices of flat buffers that
elementwise optimizers step (:mod:`lightning_zero.zero.step`) would give wrong updates. A parameter
group of such an optimizer is stepped by parameter: each of its parameters has one **owner** rank
(greedy largest-first onto the least loaded rank, as ``ZeroRedundancyOptimizer`` and DeepSpeed's
Muon balance them); at the step

1. every rank holding a piece of the parameter's fp32 master slice and of its reduced gradient slice
   sends the piece to the owner (point to point: only the elements the owner lacks move);
2. the owner steps the whole tensor with the user's optimizer, its own class and ``step()``, and
   keeps that parameter's optimizer state, whole, on its rank only;
3. the owner sends each holder its piece of the updated master back; the usual publish (stages 1/2:
   the all-gather of the parameters) or the shard itself (stage 3) carries it on.

The gradient is reduce-scattered with every other bucket during backward (overlapped with it, the
gradient sharding of stages 2/3 and the offload tiers unchanged) and then gathered: together the
bytes of a reduce to the owner. Step 3 plus publish are the bytes of a broadcast from it. The masters
stay in the flat slices, so clipping, the global norm, the overflow check and the checkpoints of the
weights are those of the elementwise path; only the optimizer states differ (whole, on the owner).

Under ``offload_optimizer="nvme"`` an optimizer with whole-tensor groups keeps its masters, gradient
slices and states in host memory (the swap files hold flat slices streamed through the Adam kernel;
the owner needs the whole tensor and its state at once); its parameter shards may still rest on disk
(``offload_parameters="nvme"``).

A group is whole-tensor when its optimizer is ``torch.optim.Muon`` or ``torch.optim.Adafactor``, or
the optimizer (class or instance) has ``whole_tensor = True``; a param group's ``"whole_tensor"`` key
overrides that per group (one optimizer may then mix both kinds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer

KNOWN_WHOLE_TENSOR: tuple[type, ...] = tuple(
    cls for cls in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None)) if cls is not None
)
"""torch optimizers stepped by parameter without any declaration."""

_TAG = 4141  # point-to-point messages of the whole-tensor step (distinct from the pipeline's)


def declared_whole_tensor(optimizer: torch.optim.Optimizer) -> bool | None:
    """The optimizer's own declaration: ``True``/``False`` from its ``whole_tensor`` attribute, ``True``
    for the known whole-tensor torch optimizers, else ``None`` (unknown)."""
    flag = getattr(optimizer, "whole_tensor", None)
    if flag is not None:
        if not isinstance(flag, bool):
            raise ValueError(
                f"{type(optimizer).__name__}.whole_tensor={flag!r} must be True or False (or absent): True steps "
                "each parameter whole on one owner rank, False steps flat slices (elementwise optimizers only)."
            )
        return flag
    return True if isinstance(optimizer, KNOWN_WHOLE_TENSOR) else None


def whole_groups(optimizer: torch.optim.Optimizer) -> set[int]:
    """Indices of the optimizer's parameter groups stepped by parameter."""
    default = bool(declared_whole_tensor(optimizer))
    out = set()
    for index, group in enumerate(optimizer.param_groups):
        flag = group.get("whole_tensor", default)
        if not isinstance(flag, bool):
            raise ValueError(
                f"parameter group {index} of {type(optimizer).__name__} has whole_tensor={flag!r}; it must be "
                "True (step each parameter whole on one owner rank) or False (flat slices)."
            )
        if flag:
            out.add(index)
    return out


def host_held(optimizers: list[torch.optim.Optimizer]) -> frozenset[int]:
    """Ids of the parameters of optimizers with whole-tensor groups: under ``offload_optimizer="nvme"``
    their masters, gradient slices and states stay in host memory (see the module docstring)."""
    return frozenset(id(p) for o in optimizers if whole_groups(o) for g in o.param_groups for p in g["params"])


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """Owner rank of each parameter: largest first onto the least loaded rank (ties: lowest rank,
    then parameter order), deterministic so that every rank computes the same."""
    loads = [0] * world_size
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += numels[index]
    return owners


@dataclass
class WholeParam:
    """One parameter of a whole-tensor group: where its pieces are and who steps it."""

    buffer: FlatBuffer
    param_index: int
    group: int
    owner: int
    key: torch.Tensor
    """What the optimizer holds for it (its ``state`` key): on the owner, the whole fp32 master
    and gradient during the step, an empty tensor of the master's dtype and device otherwise."""
    pieces: list[tuple[int, int, int, int]]
    """``(rank, param_offset, shard_offset, numel)`` of every rank's piece."""

    @property
    def param(self) -> torch.nn.Parameter:
        return self.buffer.params[self.param_index]

    @property
    def shape(self) -> torch.Size:
        return self.buffer.layout.slots[self.param_index].shape

    @property
    def numel(self) -> int:
        return self.buffer.layout.slots[self.param_index].numel


class WholeTensorStep:
    """The whole-tensor parameters of one optimizer and their gather / step / scatter-back."""

    def __init__(self, buffers: list[FlatBuffer], group_of: dict[int, int], groups: set[int], group: Any) -> None:
        self.group = group
        self.rank = comm.rank(group)
        world = comm.world_size(group)
        self.buffers = [b for b in buffers if group_of.get(id(b)) in groups]
        found: list[tuple[FlatBuffer, int, int]] = [
            (b, i, group_of[id(b)]) for b in self.buffers for i in range(len(b.params))
        ]
        owners = assign_owners([b.layout.slots[i].numel for b, i, _ in found], world)
        self.params: list[WholeParam] = []
        for (b, i, g), owner in zip(found, owners, strict=True):
            pieces = [
                (r, s.param_offset, s.shard_offset, s.numel)
                for r in range(world)
                for s in b.layout.shards(r)
                if s.param_index == i
            ]
            key = torch.empty(0, dtype=b.master.dtype, device=b.master.device)
            self.params.append(WholeParam(b, i, g, owner, key, pieces))
        self.got_gradient: set[int] | None = None  # set by the engine before each step (None: all)

    def owned(self, group_index: int) -> list[torch.Tensor]:
        """The keys this rank steps in parameter group ``group_index`` (the optimizer's ``params``)."""
        return [w.key for w in self.params if w.group == group_index and w.owner == self.rank]

    def owned_params(self) -> list[WholeParam]:
        return [w for w in self.params if w.owner == self.rank]

    def load(self) -> None:
        """Gather each owned parameter's whole master (into its key) and gradient (``key.grad``;
        None when it received no gradient this window, so the optimizer skips it as under DDP)."""
        sends = []
        for w in self.params:
            if w.owner == self.rank:
                continue
            for r, _, shard_offset, numel in w.pieces:
                if r == self.rank:
                    window = slice(shard_offset, shard_offset + numel)
                    grad = w.buffer.master.grad
                    grad_piece = grad[window] if grad is not None else torch.zeros_like(w.buffer.master[window])
                    sends.append(comm.send(w.buffer.master.detach()[window], w.owner, self.group, _TAG))
                    sends.append(comm.send(grad_piece, w.owner, self.group, _TAG))
        for w in self.owned_params():
            master = w.buffer.master
            whole = torch.empty(w.numel, dtype=master.dtype, device=master.device)
            grad = torch.zeros(w.numel, dtype=master.dtype, device=master.device)
            for r, param_offset, shard_offset, numel in w.pieces:
                target = slice(param_offset, param_offset + numel)
                if r == self.rank:
                    window = slice(shard_offset, shard_offset + numel)
                    whole[target].copy_(master.detach()[window])
                    if master.grad is not None:
                        grad[target].copy_(master.grad[window])
                    continue
                comm.recv(whole[target], r, self.group, _TAG)
                comm.recv(grad[target], r, self.group, _TAG)
            w.key.data = whole.view(w.shape)
            got = self.got_gradient is None or id(w.param) in self.got_gradient
            w.key.grad = grad.view(w.shape) if got else None
        for handle in sends:
            handle.wait()

    def store(self) -> None:
        """Send each holder its piece of the updated masters; the keys give their memory back."""
        sends = []
        for w in self.owned_params():
            flat = w.key.detach().reshape(-1)
            for r, param_offset, shard_offset, numel in w.pieces:
                piece = flat[param_offset : param_offset + numel]
                if r == self.rank:
                    w.buffer.master.detach()[shard_offset : shard_offset + numel].copy_(piece)
                else:
                    sends.append(comm.send(piece, r, self.group, _TAG))
        for w in self.params:
            if w.owner == self.rank:
                continue
            for r, _, shard_offset, numel in w.pieces:
                if r == self.rank:
                    received = torch.empty(numel, dtype=w.buffer.master.dtype, device=w.buffer.master.device)
                    comm.recv(received, w.owner, self.group, _TAG)
                    w.buffer.master.detach()[shard_offset : shard_offset + numel].copy_(received)
        for handle in sends:
            handle.wait()
        self.release()

    def release(self) -> None:
        for w in self.owned_params():
            w.key.grad = None
            w.key.data = torch.empty(0, dtype=w.key.dtype, device=w.key.device)

    # -- checkpoints ---------------------------------------------------------------------------

    def share_states(self, state: dict[Any, dict[str, Any]]) -> dict[tuple[int, int], tuple[dict, dict]]:
        """Every rank's part of the owners' whole states, in the checkpoint's per-piece form:
        ``(id(buffer), param_index) -> (slices, scalars)`` for each piece this rank holds, where
        ``slices`` are this piece (1-D) of the states shaped like the parameter (momentum) and
        ``scalars`` the others whole (``step``, Adafactor's row and column factors), as every file
        holding a piece of a parameter holds its entry. The owners send them (point to point: the
        pieces to their holders, the other states whole to each holder). Call on all ranks."""
        mine: dict[int, dict[str, Any]] = {}
        for index, w in enumerate(self.params):
            if w.owner != self.rank or not state.get(w.key):
                continue
            mine[index] = {
                k: ("slice" if v.shape == w.shape else "whole", tuple(v.shape), v.dtype)
                if torch.is_tensor(v) and v.dim() > 0
                else ("value", v)
                for k, v in state[w.key].items()
            }
        layouts: dict[int, dict[str, Any]] = {}
        for gathered in comm.all_gather_object(mine, self.group):
            layouts.update(gathered)
        sends, out = [], {}
        for index, w in enumerate(self.params):
            if w.owner != self.rank or index not in layouts:
                continue
            held = state[w.key]
            for r, param_offset, _, numel in w.pieces:
                for k, how in layouts[index].items():
                    if how[0] == "value":
                        continue
                    value = held[k].detach()
                    if how[0] == "slice":
                        value = value.reshape(-1)[param_offset : param_offset + numel]
                    if r != self.rank:
                        sends.append(comm.send(value, r, self.group, _TAG))
        for index, w in enumerate(self.params):
            if index not in layouts:
                continue
            for r, param_offset, _, numel in w.pieces:
                if r != self.rank:
                    continue
                slices: dict[str, Any] = {}
                scalars: dict[str, Any] = {}
                for k, how in layouts[index].items():
                    if how[0] == "value":
                        scalars[k] = how[1]
                        continue
                    kind, shape, dtype = how
                    if w.owner == self.rank:
                        value = state[w.key][k].detach()
                        value = value.reshape(-1)[param_offset : param_offset + numel] if kind == "slice" else value
                        value = value.to("cpu", copy=True)
                    else:
                        value = torch.empty(numel if kind == "slice" else shape, dtype=dtype, device=w.key.device)
                        comm.recv(value, w.owner, self.group, _TAG)
                        value = value.cpu()
                    (slices if kind == "slice" else scalars)[k] = value
                out[(id(w.buffer), w.param_index)] = (slices, scalars)
        for handle in sends:
            handle.wait()
        return out


KNOWN_WHOLE_MODEL: tuple[type, ...] = (torch.optim.LBFGS,)
"""torch optimizers stepped replicated over all parameters (:mod:`lightning_zero.zero.replicated`)
without any declaration."""


def declared_whole_model(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps replicated: its ``whole_model`` attribute, else True for LBFGS."""
    flag = getattr(optimizer, "whole_model", None)
    if flag is None:
        return isinstance(optimizer, KNOWN_WHOLE_MODEL)
    if not isinstance(flag, bool):
        raise ValueError(
            f"{type(optimizer).__name__}.whole_model={flag!r} must be True or False (or absent): True steps the "
            "optimizer on every rank over the full parameters and averaged gradients, as DDP does."
        )
    return flag
