"""``param.grad`` as DDP has it, for the user code that reads it: full gradients gathered from the
ranks' reduced slices (the output of step 3, reduce) and written back into them after the user's code.

Under ZeRO a gradient never stays in ``param.grad``: autograd's value goes into a bucket at once and
each rank keeps only its reduced slice. Code written for DDP reads whole gradients, in
``on_before_optimizer_step`` (Lightning's ``grad_norm(self, 2)`` utility, a check for NaNs), in
``configure_gradient_clipping`` (``p.grad.clamp_``), or after ``manual_backward``. An
:class:`ExposedGrads` all-gathers each flat buffer's slices into one full-size tensor and makes each
parameter's ``.grad`` a view of it (a copy in the parameter's dtype under mixed precision: torch
wants ``grad.dtype == param.dtype``). :meth:`ExposedGrads.write_back` puts elementwise edits back
into this rank's slice, so that the step uses them, as DDP's step uses an edited ``param.grad``; an
element is taken where it differs from the slice as the parameter's dtype rounds it (so an unedited
16-bit copy never overwrites the fp32 gradient with its rounding).

Cost while exposed: one all-gather of every exposed buffer's gradient slices, and their full size
in the slice's dtype (fp32 under mixed precision: 4 bytes per parameter, plus 2 for the 16-bit
copies): the memory that stage 2 saves. Used by :meth:`ZeroEngine.full_gradients` (and the
``expose_param_grads`` option of :class:`~lightning_zero.config.ZeroConfig`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer

_WARNED: set[str] = set()


def _warn_no_piece() -> None:
    if "piece" not in _WARNED:
        _WARNED.add("piece")
        warnings.warn(
            "ZeRO stage 3 with offload_parameters on a GPU (or on disk): a released parameter is an empty "
            "tensor, so its .grad is left None; read gradients with strategy.full_gradients(module) instead.",
            stacklevel=3,
        )


class ExposedGrads:
    """Full gradients of ``buffers`` as ``param.grad`` of the parameters in ``wanted``.

    Args:
        buffers: the flat buffers whose parameters get ``.grad``.
        slices: ``id(buffer) -> this rank's gradient slice`` (shape ``(shard_numel,)``; ``master.grad``
            at the step); a buffer without one has no gradient (its parameters keep None).
        wanted: ids of the parameters that get ``.grad`` (those that received a gradient, as DDP).
        group: the data-parallel group.
        device: where the full gradients are gathered (the compute device).
        local: ids of stage-3 buffers whose parameters are released (each a view of this rank's
            piece of it): they get the matching piece of the slice as ``.grad``, without
            communication (read-only; see :meth:`ZeroEngine.expose_window`).
        read_only: no :meth:`write_back` follows (the window of manual optimization): an edit of
            an exposed ``.grad`` (``clip_grad_norm_``, ``clamp_``, a replaced tensor) would be lost, so
            :meth:`release` warns about it instead of letting the step ignore it silently.
    """

    def __init__(
        self,
        buffers: list[FlatBuffer],
        slices: dict[int, torch.Tensor],
        wanted: set[int],
        group: comm.ProcessGroup,
        device: torch.device,
        local: frozenset[int] = frozenset(),
        read_only: bool = False,
    ) -> None:
        self.buffers = [b for b in buffers if id(b) in slices]
        self.slices = slices
        self.wanted = wanted
        self.group = group
        self.device = device
        self.local = local
        self.read_only = read_only
        self.full: dict[int, torch.Tensor] = {}
        self.assigned: list[tuple[FlatBuffer, int, nn.Parameter]] = []
        self.versions: list[tuple[torch.Tensor, int]] = []  # read_only: each .grad as set, its version

    def gather(self) -> None:
        """All-gather every buffer's slices and set ``param.grad``. Call on all ranks."""
        self.release()
        for b in self.buffers:
            if id(b) in self.local:
                self._own_pieces(b)
                continue
            grad = self.slices[id(b)]
            full = torch.empty(b.layout.padded_numel, dtype=grad.dtype, device=self.device)
            comm.all_gather(full, grad.to(self.device), self.group, label="full_gradients")
            self.full[id(b)] = full
            for index, (param, slot) in enumerate(zip(b.params, b.layout.slots, strict=True)):
                if id(param) in self.wanted:
                    param.grad = full[slot.offset : slot.offset + slot.numel].view(slot.shape).to(param.dtype)
                    self._assigned(b, index, param)

    def _own_pieces(self, b: FlatBuffer) -> None:
        """A released stage-3 parameter holds this rank's piece of it (1-D, or its own shape when
        the piece is all of it; empty where the rank holds none): its ``.grad`` is the same piece of
        the gradient, as FSDP2's sharded ``.grad`` of a sharded parameter."""
        grad = self.slices[id(b)]
        pieces = {s.param_index: s for s in b.shards}
        for index, param in enumerate(b.params):
            if id(param) not in self.wanted:
                continue
            piece = pieces.get(index)
            if piece is None:
                value = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            elif param.numel() != piece.numel:
                # the released parameter is an empty tensor (its shard is in host memory or on disk:
                # FlatBuffer.bind_released), and autograd takes no .grad of another shape
                _warn_no_piece()
                continue
            else:
                value = grad[piece.shard_offset : piece.shard_offset + piece.numel].view(param.shape)
            param.grad = value.to(device=param.device, dtype=param.dtype)
            self._assigned(b, index, param)

    def _assigned(self, b: FlatBuffer, index: int, param: nn.Parameter) -> None:
        self.assigned.append((b, index, param))
        if self.read_only:
            grad = param.grad
            assert grad is not None
            self.versions.append((grad, grad._version))

    def write_back(self) -> None:
        """Elementwise edits of the exposed ``param.grad`` (in place or a replaced tensor) into this
        rank's slices. Local."""
        with torch.no_grad():
            for b, index, param in self.assigned:
                if id(b) in self.local:
                    continue  # (read-only pieces)
                full, slot = self.full[id(b)], b.layout.slots[index]
                region = full[slot.offset : slot.offset + slot.numel]
                if param.grad is not None and param.grad.data_ptr() != region.data_ptr():
                    region.copy_(param.grad.reshape(-1))  # a cast copy (mixed precision) or a new tensor
            for b in self.buffers:
                if id(b) in self.local:
                    continue
                start, end = b.layout.shard_range(b.rank)
                own, grad = self.full[id(b)][start:end].to(self.slices[id(b)].device), self.slices[id(b)]
                rounded = grad.to(b.dtype).to(grad.dtype)  # what an unedited copy in the parameter's dtype holds
                torch.where(own != rounded, own, grad, out=grad)

    def release(self) -> None:
        """Every exposed ``param.grad`` back to None, the full tensors freed (read-only: a warning
        when one of them was edited, see the ``read_only`` argument)."""
        if self.read_only and any(
            param.grad is not None and (param.grad is not grad or grad._version != version)
            for (_, _, param), (grad, version) in zip(self.assigned, self.versions, strict=True)
        ):
            warnings.warn(
                "param.grad was edited after manual_backward (e.g. torch.nn.utils.clip_grad_norm_ or p.grad.clamp_): "
                "under ZeRO those .grad are read-only copies of the reduced gradients, so the edit does NOT reach "
                "optimizer.step(). Clip with self.clip_gradients(optimizer, gradient_clip_val=..., "
                "gradient_clip_algorithm=...) before optimizer.step(), or edit gradients inside "
                "`with self.trainer.strategy.full_gradients():` there.",
                stacklevel=3,
            )
        self.versions.clear()
        for _, _, param in self.assigned:
            param.grad = None
        self.assigned.clear()
        self.full.clear()


def window_slice(buffer: FlatBuffer, stage: int, group: comm.ProcessGroup, inv_scale: float) -> torch.Tensor:
    """This rank's slice of the window's averaged, unscaled gradients so far, between two backwards
    (before the step exposes them as ``master.grad``), as a new tensor in the master's dtype:
    stages 2/3 hold it reduced in ``grad_shard``; stage 1 holds unreduced sums in its kept bucket,
    reduced here into a copy (one reduce-scatter). Call on all ranks."""
    assert buffer.grad_shard is not None  # a trainable buffer
    if stage == 1 and buffer.grad_bucket is not None:
        bucket = buffer.grad_bucket.clone()
        out = torch.empty_like(buffer.grad_shard)
        comm.reduce_scatter(out, bucket, group, clobber_input=True, label="expose_param_grads")
        out.div_(comm.world_size(group))
    elif buffer.grad_tier is not None:  # the slice rests on disk (zero/swap_grads.py)
        with buffer.grad_tier.resident(buffer, write=False):
            return buffer.grad_shard.to(buffer.master.dtype, copy=True).mul_(inv_scale).to(buffer.master.device)
    else:
        out = buffer.grad_shard
    return out.to(buffer.master.dtype, copy=True).mul_(inv_scale).to(buffer.master.device)
