"""The checkpoint surface of :class:`~lightning_zero.zero.engine.ZeroEngine`: this rank's pieces of
every held parameter and optimizer state out (:meth:`CheckpointSurface.local_pieces`) and back in
(:meth:`~CheckpointSurface.load_pieces`, :meth:`~CheckpointSurface.load_optimizer_pieces`,
:meth:`~CheckpointSurface.load_consolidated`), streaming through the disk tier one flat buffer at a
time. A mixin: the engine owns the buffers, optimizers and tiers it reads (declared below).

Each byte is touched once where it can be: the pieces a save writes are the host tensors
themselves, in storages of their own size (:func:`exact_storage`, no copy out of the flat buffer);
a load writes each piece from the (memory-mapped) file straight into the master, and into the
optimizer's own state tensors when it has them (no new allocation, no zero-fill: only what no
piece covers is zeroed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero import comm
from lightning_zero.config import StrategyConfig
from lightning_zero.offload.nvme import SwapStore
from lightning_zero.zero.flat import FlatBuffer
from lightning_zero.zero.replicated import ReplicatedOptimizer
from lightning_zero.zero.step import ShardedOptimizer
from lightning_zero.zero.surface import (
    HeldParam,
    LocalPiece,
    OptimizerPiece,
    OptimizerPieceReader,
    PieceReader,
)
from lightning_zero.zero.swap import EngineSwap, ParamTier
from lightning_zero.zero.whole import WholeParam


def _unwrap(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # Lightning hands hooks a LightningOptimizer wrapper; the engine keys on the wrapped optimizer.
    return getattr(optimizer, "_optimizer", optimizer)


def _host_copy(tensor: torch.Tensor, own: bool = False) -> torch.Tensor:
    """``tensor`` on the CPU in a storage of its own size: torch.save writes a view's whole storage,
    and without a separate master the master slice is a view of the full flat buffer. A contiguous
    CPU tensor is not copied: a view of a larger storage becomes a tensor over the same memory whose
    storage is exactly its bytes (:func:`exact_storage`). ``own``: always a copy (the disk tier
    frees the original's storage once the checkpoint has read it)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu" and tensor.is_contiguous() and not own:
        return exact_storage(tensor)
    return tensor.to("cpu", copy=True).contiguous()


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU ``tensor`` over the same memory, in a storage of exactly its bytes (itself
    when it is one already): what torch.save writes of it is its elements, not the storage it views.
    No copy: the NumPy array in between keeps ``tensor``'s storage alive. (Saving a 1 GiB shard
    spent ~0.3-0.8 s copying the master out of the flat buffer into fresh pages before this.)"""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() or tensor.numel() == 0:
        return tensor
    as_bytes = tensor.reshape(-1).view(torch.uint8)  # NumPy has no bfloat16: through bytes
    return torch.from_numpy(as_bytes.numpy()).view(tensor.dtype).view(tensor.shape)


class CheckpointSurface:
    """Checkpoint methods of the engine (see the module docstring)."""

    config: StrategyConfig
    group: comm.ProcessGroup
    swap: EngineSwap | None
    param_tier: ParamTier | None
    _states_dropped: bool
    _published_on_load: set[int]
    _optimizers: list[torch.optim.Optimizer]
    _sharded: dict[int, ShardedOptimizer]
    _held: list[HeldParam]

    if TYPE_CHECKING:
        # The engine's (declared for the type checker only: a stub here would be found before the
        # real method when this mixin comes before the one that defines it among the bases).
        def _all_buffers(self) -> list[FlatBuffer]: ...
        def _get(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer: ...

    @contextmanager
    def _resident(self) -> Iterator[None]:
        """Swapped masters and states in host memory for the block (no-op without the disk tier);
        under the parameter disk tier also the shards of frozen buffers (their own masters)."""
        with contextlib.ExitStack() as stack:
            if self.swap is not None:
                stack.enter_context(self.swap.resident())
            if self.param_tier is not None:
                stack.enter_context(self.param_tier.resident_masters())
            yield

    def _store(self) -> SwapStore | None:
        if self.swap is not None:
            return self.swap.store
        return self.param_tier.store if self.param_tier is not None else None

    @contextmanager
    def _buffer_resident(self, b: FlatBuffer) -> Iterator[None]:
        """``b``'s master in host memory for the block when the disk tier holds it (one buffer at a
        time: checkpoints stream through the tier), written back after."""
        with contextlib.ExitStack() as stack:
            if self.swap is not None:
                stack.enter_context(self.swap.resident_buffer(b, master_only=True))
            if self.param_tier is not None and b.master is b.param_shard:
                stack.enter_context(self.param_tier.resident_one(b))
            yield

    def _snapshot(self, tensor: torch.Tensor, own: bool) -> torch.Tensor:
        """A host copy of ``tensor``, or under the disk tier a memory map of its swap file."""
        store = self._store()
        mapped = store.mapped(tensor) if store is not None else None
        return mapped if mapped is not None else _host_copy(tensor, own)

    def check_saveable(self) -> None:
        """ValueError when the disk tier's files were removed unread at the end of fit (nothing to save)."""
        if self._states_dropped:
            raise ValueError(
                "the optimizer states, fp32 masters (and parameter shards) of this run were on the disk tier and were "
                "removed at the end of fit without being read back (nvme restore_after_fit=False, the default with "
                'offload_parameters="nvme", or fit failed); save checkpoints during fit (ModelCheckpoint) and take the '
                "weights from them (lightning_zero.checkpoint.consolidate), or set restore_after_fit=True when the "
                "model and its states fit in RAM."
            )

    def local_pieces(self, views: bool = False) -> list[LocalPiece | None]:
        """This rank's piece of every :meth:`held_params` entry (``None`` where it holds none), in
        host memory: views of one copy per flat buffer, so each buffer is written once (of host
        memory itself, no copy). Under the disk tier the swapped masters and states are memory maps of
        their files, valid until the next step (a save streams them from disk; nothing is brought into
        anonymous memory). ``views``: the tensors where they are (a device, the disk tier), nothing
        copied, mapped or absorbed: their sizes, for sizing an async save's host buffer. Local."""
        self.check_saveable()
        buffers = self._all_buffers()
        if self.config.zero.absorb_param_edits and not views:
            for b in buffers:
                if not b.separate_master or b.shard_tier is not None:
                    continue  # nothing to absorb (see FlatBuffer.absorb_edits): no disk round trip
                with self._buffer_resident(b):
                    b.absorb_edits()  # a checkpoint saves the weights the model holds (edits in hooks included)
        own = self._store() is not None

        def snapshot(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.detach() if views else self._snapshot(tensor, own)

        # whole-tensor groups: the owners' whole states, as every holder's per-piece entries (a collective)
        whole: dict[int, dict[tuple[int, int], tuple[dict, dict]]] = {}
        for o_index, optimizer in enumerate(self._optimizers):
            stepper = self._sharded[id(optimizer)].whole
            if stepper is not None and not views:
                whole[o_index] = stepper.share_states(optimizer.state)
            replicated = self._sharded[id(optimizer)]
            if isinstance(replicated, ReplicatedOptimizer) and not views:
                whole[o_index] = replicated.piece_states()  # the same on every rank: each piece's file has it
        position = {id(p): (id(b), i) for b in buffers for i, p in enumerate(b.params)}
        # per buffer: the master's host copy and, per optimizer holding it, its states' copies
        copies: list[tuple[torch.Tensor, dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]]]] = []
        for b in buffers:
            states = {}
            for o_index, optimizer in enumerate(self._optimizers):
                if all(b is not mine for mine in self._sharded[id(optimizer)].buffers):
                    continue
                raw = optimizer.state.get(b.master, {})
                slices = {k: snapshot(v) for k, v in raw.items() if self._is_slice(v, b)}
                scalars = {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for k, v in raw.items()
                    if not self._is_slice(v, b)
                }
                states[o_index] = (slices, scalars)
            copies.append((snapshot(b.master), states))
        out: list[LocalPiece | None] = []
        for held in self._held:
            if held.local is None:
                out.append(None)
                continue
            _, shard_offset, numel = held.local
            window = slice(shard_offset, shard_offset + numel)
            master, states = copies[held.buffer]
            pieces = {
                o_index: OptimizerPiece({k: v[window] for k, v in slices.items()}, scalars)
                for o_index, (slices, scalars) in states.items()
            }
            for o_index, parts in whole.items():
                part = parts.get(position[id(held.param)])
                if part is not None:  # this piece of the owner's whole state
                    pieces[o_index] = OptimizerPiece(*part)
            out.append(LocalPiece(master[window], pieces))
        return out

    @staticmethod
    def _is_slice(value: Any, buffer: FlatBuffer) -> bool:
        # one element per master element (exp_avg), not a scalar (step)
        return torch.is_tensor(value) and value.shape == buffer.master.shape

    def load_pieces(self, read: PieceReader) -> None:
        """Overwrite this rank's master pieces with ``read(param, param_offset, numel)`` (where it
        returns a tensor). Local: call :meth:`publish` afterwards."""
        buffers = self._all_buffers()
        by_buffer: dict[int, list[HeldParam]] = {}
        for held in self._held:
            if held.local is not None:
                by_buffer.setdefault(held.buffer, []).append(held)
        disk = self._store() is not None
        with torch.no_grad():
            for index, pieces in by_buffer.items():
                b = buffers[index]
                with self._buffer_resident(b):  # the disk tier: one buffer in memory at a time
                    for held in pieces:
                        assert held.local is not None
                        param_offset, shard_offset, numel = held.local
                        value = read(held, param_offset, numel)
                        if value is not None:
                            b.master[shard_offset : shard_offset + numel].copy_(value)
                    if disk and b.separate_master:
                        # publish()'s cast into the parameter slice now, while the master is in memory,
                        # so a resume reads each master from disk once (publish skips this buffer)
                        tier = b.shard_tier.rewrite([b]) if b.shard_tier is not None else contextlib.nullcontext()
                        with tier:
                            b.params_from_master()
                        self._published_on_load.add(id(b))

    def load_pieces_local(self, read: PieceReader) -> None:
        """:meth:`load_pieces`, then every separate master cast into this rank's parameter slice,
        without communication (no :meth:`publish`): for a caller that also writes every whole
        parameter itself with the same values (``module.load_state_dict`` of a full state dict, which
        copies into the parameters stages 1/2 and small stage-3 ones keep whole). Local."""
        self.load_pieces(read)
        cast, self._published_on_load = self._published_on_load, set()
        with torch.no_grad():
            for b in self._all_buffers():
                if not b.separate_master or id(b) in cast:
                    continue
                with contextlib.ExitStack() as stack:
                    stack.enter_context(self._buffer_resident(b))
                    if b.shard_tier is not None:
                        stack.enter_context(b.shard_tier.rewrite([b]))
                    b.params_from_master()

    def load_optimizer_pieces(
        self, optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]], read: OptimizerPieceReader
    ) -> None:
        """Load ``optimizer``'s state piece by piece (``read`` returns each piece's states) and the
        hyperparameters of ``saved_groups``. Local."""
        index = next(i for i, o in enumerate(self._optimizers) if o is _unwrap(optimizer))
        buffers = self._all_buffers()
        sharded = self._get(optimizer)
        stepper = sharded.whole
        skip = {id(b) for b in stepper.buffers} if stepper is not None else set()
        whole_state = self._read_whole(stepper.owned_params(), read) if stepper is not None else {}
        if isinstance(sharded, ReplicatedOptimizer):  # every rank takes every parameter's whole state
            skip = {id(b) for b in sharded.buffers}
            whole_state = self._read_whole(sharded.keyed, read)
        state: dict[int, dict[str, Any]] = {}
        filled: dict[int, list[tuple[int, int]]] = {}  # per buffer: the (shard_offset, numel) read
        current: FlatBuffer | None = None  # the buffer being filled (held params come buffer by buffer)
        for held in self._held:
            if index not in held.optimizers or held.local is None or id(buffers[held.buffer]) in skip:
                continue
            if self.swap is not None and current is not None and current is not buffers[held.buffer]:
                self._zero_unread(current, state, filled)
                self._adopt(current, state)  # the disk tier: one buffer's states in memory at a time
            current = buffers[held.buffer]
            param_offset, shard_offset, numel = held.local
            piece = read(held, param_offset, numel)
            if piece is None:
                continue
            buffer = buffers[held.buffer]
            # Cloned: Adam increments "step" in place, so buffers must not share one tensor.
            scalars = {k: v.clone() if torch.is_tensor(v) else v for k, v in piece.scalars.items()}
            target = state.setdefault(id(buffer), scalars)
            for key, value in piece.slices.items():
                if key not in target:
                    target[key] = self._state_destination(index, buffer, key, value.dtype)
                target[key][shard_offset : shard_offset + numel] = value  # the one copy out of the file
            filled.setdefault(id(buffer), []).append((shard_offset, numel))
        for buffer in buffers if self.swap is None else [current] if current is not None else []:
            self._zero_unread(buffer, state, filled)
        if self.swap is not None and current is not None:
            self._adopt(current, state)
        if self.swap is None:
            self._get(optimizer).load_slices(state, saved_groups, whole_state)
            return
        # The disk tier: the adopted states stay on disk (load_state_dict only needs the masters'
        # dtype and device); a state tensor that torch replaced anyway takes over its file.
        self._get(optimizer).load_slices(state, saved_groups, whole_state)
        self.swap.settle()

    def _read_whole(self, owned: list[WholeParam], read: OptimizerPieceReader) -> dict[int, dict[str, Any]]:
        """The whole states of the parameters this rank steps (``id(key) -> state``), read from the
        pieces of whichever ranks saved them (the owner may hold no piece, or the world size changed)."""
        held_of = {id(h.param): h for h in self._held}
        out: dict[int, dict[str, Any]] = {}
        for w in owned:
            piece = read(held_of[id(w.param)], 0, w.numel)
            if piece is None or not (piece.scalars or piece.slices):
                continue
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in piece.scalars.items()}
            state.update({k: v.reshape(w.shape).clone() for k, v in piece.slices.items()})
            out[id(w.key)] = state
        return out

    def _state_destination(self, index: int, buffer: FlatBuffer, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Where a loaded state ``key`` of ``buffer``'s shard goes: the optimizer's own tensor when it
        has one of that shape and dtype in host memory (a load during or after fit: written in place,
        no allocation, and the old one is not freed while the new one is faulted in), else a new one.
        Not zero-filled: the load writes every piece, :meth:`_zero_unread` the rest (padding)."""
        held = self._optimizers[index].state.get(buffer.master, {}).get(key)
        numel = buffer.layout.shard_numel
        if (
            self.swap is None
            and torch.is_tensor(held)
            and held.device.type == "cpu"
            and held.dtype == dtype
            and held.is_contiguous()
            and held.numel() == numel
        ):
            return held.view(-1)
        return torch.empty(numel, dtype=dtype)

    @staticmethod
    def _zero_unread(buffer: FlatBuffer, state: dict[int, dict[str, Any]], filled: dict[int, list]) -> None:
        """Zero the elements of ``buffer``'s loaded states that no piece was read into (the shard's
        padding, parameters the checkpoint lacks): what a zero-filled state held there."""
        slices = [v for v in state.get(id(buffer), {}).values() if torch.is_tensor(v) and v.dim() == 1]
        if not slices:
            return
        done = 0
        for offset, numel in [*sorted(filled.get(id(buffer), [])), (buffer.layout.shard_numel, 0)]:
            if offset > done:
                for value in slices:
                    if value.numel() == buffer.layout.shard_numel:
                        value[done:offset].zero_()
            done = max(done, offset + numel)

    def _adopt(self, buffer: FlatBuffer, state: dict[int, dict[str, Any]]) -> None:
        assert self.swap is not None
        slices = {
            k: v for k, v in state.get(id(buffer), {}).items() if torch.is_tensor(v) and self._is_slice(v, buffer)
        }
        if slices and all(SwapStore.resident(v) for v in slices.values()):
            self.swap.adopt(buffer, slices)

    def load_consolidated(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load an unsharded optimizer state (a plain optimizer's); every rank keeps its slice. Local:
        call :meth:`publish` afterwards (it may carry fp32 masters)."""
        with self._resident():
            self._get(optimizer).load_consolidated_state_dict(state_dict)

    def full_params(self, keep: bool) -> dict[int, torch.Tensor]:
        """``id(param) -> the whole parameter`` in the saved dtype (the fp32 master under mixed
        precision), in host memory, for a "full" checkpoint's module state as DDP's: one flat buffer
        all-gathered at a time; only a rank with ``keep`` (rank 0) keeps them (the whole model in its
        host memory while the save runs), the others drop each buffer at once (empty result). Call
        on all ranks."""
        out: dict[int, torch.Tensor] = {}
        for b in self._all_buffers():
            with self._buffer_resident(b):
                full = torch.empty(b.layout.padded_numel, dtype=b.master.dtype, device=b.master.device)
                comm.all_gather(full, b.master.detach(), self.group, label="full checkpoint: module state")
            if not keep:
                continue
            full = full.to("cpu")
            for param, slot in zip(b.params, b.layout.slots, strict=True):
                out[id(param)] = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
        return out
