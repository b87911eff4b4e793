"""Runs one stage's pipeline schedule: micro-batches, activations to the next stage, gradients back.

Per training batch on stage ``s`` of ``P`` (group ranks of the pipeline group are the stages):

* the batch is split into ``m`` micro-batches along dim 0 (:func:`split_batch`; fewer when the
  batch has fewer rows, sizes differing by one when ``m`` does not divide it);
* ``F i``: the first stage feeds ``spec.inputs(micro_batch)`` to its layers, the others receive the
  previous stage's output; the last stage applies ``spec.loss``, the others send their output on;
* ``B i``: the last stage backwards ``loss_i * w_i * scale`` (``w_i`` the micro-batch's share of the
  rows, ``scale`` = loss scale / gradient accumulation, so the summed gradients are those of the
  batch mean when every row weighs the same in the loss), the others receive the
  gradient of their output; afterwards the input gradients go back to the previous stage and
  ``after_backward`` completes ZeRO's reductions of that backward;
* the row-weighted mean of the micro-batch losses is broadcast from the last stage, so every rank
  returns (and logs) the batch's loss.

Messages: every send is a fixed-size int64 header (count, the micro-batch and virtual stage it
comes from, checked by the receiver, and per tensor its dtype, whether it needs a gradient, its
shape) followed by the tensors, so stages need not know shapes in advance and a batch may change its
sequence length. Activations and gradients travel under different tags: with interleaving (model
chunks, a ring of stages) one neighbour may get both. Sends are asynchronous and receives block; with the
schedules of :mod:`.schedules` every receive is matched by a send that does not wait on it, so no
stage can deadlock. Only floating tensors that need a gradient on the sending side get one back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_zero import comm
from lightning_zero.config import PipelineConfig
from lightning_zero.parallel.pipeline import PipelineSpec
from lightning_zero.parallel.schedules import forward_only, interleavable, schedule

_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
_HEADER = 64  # int64 slots: enough for 8 tensors of up to 5 dims


def split_batch(batch: Any, micro_batches: int) -> tuple[list[Any], list[float]]:
    """``batch`` cut along dim 0 of every tensor (dicts, lists and tuples recursively; other leaves
    are repeated) into ``min(micro_batches, batch size)`` pieces whose sizes differ by at most one,
    and each piece's share of the rows (the weights of the micro-batch losses in the batch mean).
    A batch size that ``micro_batches`` does not divide (a short last batch) is fine."""
    sizes: set[int] = set()

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            sizes.add(x.shape[0])
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(batch)
    if len(sizes) != 1:
        raise ValueError(
            f"a pipeline splits every tensor of the batch along dim 0, but their sizes there are {sorted(sizes)}; "
            "give the batch tensors that share their first (batch) dimension"
        )
    size = sizes.pop()
    count = min(micro_batches, size)
    bounds = [size * i // count for i in range(count + 1)]

    def piece(x: Any, i: int) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x[bounds[i] : bounds[i + 1]]
        if isinstance(x, dict):
            return type(x)((k, piece(v, i)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(piece(v, i) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(piece(v, i) for v in x)
        return x

    return [piece(batch, i) for i in range(count)], [(bounds[i + 1] - bounds[i]) / size for i in range(count)]


def _as_tuple(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    out = x if isinstance(x, tuple) else (x,)
    if not all(isinstance(t, torch.Tensor) for t in out):
        raise ValueError(
            f"{what} must be a tensor or a tuple of tensors under pipeline parallelism, got {type(x).__name__}"
        )
    return out


@dataclass
class StageTimes:
    """Wall time of the latest :meth:`PipelineRunner.run` and the part of it spent blocked in
    receives: ``waiting_s / total_s`` is this stage's measured bubble (idle) fraction, to compare
    with :func:`~lightning_zero.parallel.schedules.bubble_fraction`."""

    total_s: float = 0.0
    waiting_s: float = 0.0

    @property
    def idle_fraction(self) -> float:
        return self.waiting_s / self.total_s if self.total_s > 0 else 0.0


ACTIVATION, GRADIENT = 0, 1
"""Message tags: a stage may send both kinds to the same neighbour (interleaved, two stages)."""


class Peer:
    """Messages to and from one neighbouring stage (group rank ``rank`` of the pipeline ``group``)."""

    def __init__(self, group: comm.ProcessGroup, rank: int, device: torch.device) -> None:
        self.group, self.rank, self.device = group, rank, device
        self.pending: list[tuple[comm.Handle, list[torch.Tensor]]] = []
        self.waiting_s = 0.0  # time blocked in recv() since the runner last reset it

    def send(self, tensors: Sequence[torch.Tensor], grads: Sequence[bool], tag: int, ident: tuple[int, int]) -> None:
        """Send ``tensors`` (``grads``: which need a gradient back) labelled ``ident`` =
        (micro-batch, sending virtual stage), without waiting."""
        header = [len(tensors), *ident]
        for t, g in zip(tensors, grads, strict=True):
            if t.dtype not in _DTYPES:
                raise ValueError(f"cannot send a {t.dtype} tensor between pipeline stages; use one of {_DTYPES}")
            header += [_DTYPES.index(t.dtype), int(g), t.dim(), *t.shape]
        if len(header) > _HEADER:
            raise ValueError(
                f"a stage output of {len(tensors)} tensors with shapes {[tuple(t.shape) for t in tensors]} is too large a message header"
            )
        header_t = torch.tensor(header + [-1] * (_HEADER - len(header)), dtype=torch.int64, device=self.device)
        payload = [header_t] + [t.detach().contiguous() for t in tensors]
        for t in payload:
            self.pending.append((comm.send(t, self.rank, self.group, tag), [t]))

    def recv(self, tag: int, ident: tuple[int, int]) -> tuple[list[torch.Tensor], list[bool]]:
        """The next message with ``tag``; it must be labelled ``ident`` (a schedule bug otherwise)."""
        header_t = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        start = time.perf_counter()
        comm.recv(header_t, self.rank, self.group, tag)  # the wait for the other stage is here
        self.waiting_s += time.perf_counter() - start
        header = header_t.tolist()
        if tuple(header[1:3]) != ident:
            raise RuntimeError(
                f"pipeline message from stage {self.rank}: expected micro-batch {ident[0]} of virtual stage {ident[1]}, "
                f"got micro-batch {header[1]} of virtual stage {header[2]} (the stages run different schedules)"
            )
        tensors, grads, at = [], [], 3
        for _ in range(header[0]):
            dtype, grad, ndim = _DTYPES[header[at]], bool(header[at + 1]), header[at + 2]
            shape = header[at + 3 : at + 3 + ndim]
            at += 3 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            comm.recv(t, self.rank, self.group, tag)
            tensors.append(t)
            grads.append(grad)
        return tensors, grads

    def wait(self) -> None:
        """Wait until every send has left (its buffers may then be freed)."""
        for handle, _ in self.pending:
            handle.wait()
        self.pending.clear()


class PipelineRunner:
    """Executes the schedule of one stage.

    Args:
        chunks: this stage's model chunks (one without interleaving), each a list of layers in
            order; chunk ``c`` is virtual stage ``c * stages + stage``.
        spec: the model's :class:`~lightning_zero.parallel.pipeline.PipelineSpec`.
        stage: this stage.
        config: the pipeline options: P (``stages``), m (``num_micro_batches``) and the training
            schedule, "1f1b" or "gpipe" (evaluation runs forwards only).
        group: the pipeline-parallel group (group rank = stage).
        device: where received tensors are placed.
    """

    def __init__(
        self,
        chunks: Sequence[Sequence[nn.Module]],
        spec: PipelineSpec,
        *,
        stage: int,
        config: PipelineConfig,
        group: comm.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.chunks = [list(layers) for layers in chunks]
        self.spec = spec
        stages = config.stages
        self.stage, self.stages, self.group = stage, stages, group
        self.micro_batches, self.schedule_name = config.num_micro_batches, config.schedule
        self.last_virtual = stages * len(self.chunks) - 1
        self.peers = {r: Peer(group, r, device) for r in {(stage - 1) % stages, (stage + 1) % stages} if r != stage}
        self.device = device
        self.train_actions: list = []  # the schedule of the latest training batch (tests and reports)
        self.times = StageTimes()  # of the latest run (benchmarks/parallel3d.py reads it)

    def _virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def _forward(self, chunk: int, args: tuple[torch.Tensor, ...]) -> Any:
        out: Any = args
        for layer in self.chunks[chunk]:
            out = layer(*(out if isinstance(out, tuple) else (out,)))
        return out

    def run(
        self,
        batch: Any,
        train: bool,
        scale: float = 1.0,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        after_backward: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Forward (and with ``train`` backward) every micro-batch of ``batch``; returns the batch's
        loss (fp32 scalar, the same on every stage). Call on all stages."""
        micro, weights = split_batch(batch, self.micro_batches)
        m, v = len(micro), len(self.chunks)  # the same on every stage: they read the same batch
        if train:
            name = self.schedule_name
            if v > 1 and not interleavable(self.stages, m):
                name = "gpipe"  # a short batch that cannot fill groups of P micro-batches
            actions = schedule(name, self.stage, self.stages, m, v)
            self.train_actions = actions
        else:
            actions = forward_only(self.stage, self.stages, m, v)
        live: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], list[bool], Any]] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for peer in self.peers.values():
            peer.waiting_s = 0.0
        start = time.perf_counter()
        try:
            for action in actions:
                i, c = action.micro_batch, action.chunk
                if action.kind == "F":
                    total += weights[i] * self._run_forward(i, c, micro[i], train, live)
                else:
                    self._run_backward(i, c, weights[i] * scale, scale_loss, live)
                    if after_backward is not None:
                        after_backward()
        finally:
            for peer in self.peers.values():
                peer.wait()
        # (on a GPU these are host times: a blocked recv also covers kernels still queued before it)
        self.times = StageTimes(time.perf_counter() - start, sum(p.waiting_s for p in self.peers.values()))
        comm.broadcast(total, self.last_virtual % self.stages, self.group, label="pipeline loss")
        return total

    def _run_forward(self, i: int, c: int, micro_batch: Any, train: bool, live: dict) -> torch.Tensor:
        k = self._virtual(c)
        if k == 0:
            args = _as_tuple(self.spec.inputs(micro_batch), "PipelineSpec.inputs(batch)")
            wants: list[bool] = [False] * len(args)
        else:
            received, wants = self.peers[(self.stage - 1) % self.stages].recv(ACTIVATION, (i, k - 1))
            args = tuple(t.requires_grad_() if w and train else t for t, w in zip(received, wants, strict=True))
        with torch.set_grad_enabled(train):
            out = self._forward(c, args)
            if k == self.last_virtual:
                loss = self.spec.loss(out, micro_batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"PipelineSpec.loss must return a scalar tensor, got {loss!r}")
                if train:
                    live[(i, c)] = (args, wants, loss)
                return loss.detach().float().reshape(())
        outs = _as_tuple(out, f"the output of virtual stage {k}'s last layer")
        grads = [train and t.requires_grad and t.is_floating_point() for t in outs]
        self.peers[(self.stage + 1) % self.stages].send(outs, grads, ACTIVATION, (i, k))
        if train:
            live[(i, c)] = (args, wants, outs)
        return torch.zeros((), dtype=torch.float32, device=self.device)

    def _run_backward(self, i: int, c: int, scale: float, scale_loss: Callable | None, live: dict) -> None:
        args, wants, out = live.pop((i, c))
        k = self._virtual(c)
        if k == self.last_virtual:
            loss = out * scale
            torch.autograd.backward(scale_loss(loss) if scale_loss is not None else loss)
        else:
            grads, _ = self.peers[(self.stage + 1) % self.stages].recv(GRADIENT, (i, k + 1))
            needing = [t for t in out if t.requires_grad and t.is_floating_point()]
            if len(grads) != len(needing):
                raise RuntimeError(
                    f"virtual stage {k}: received {len(grads)} output gradients for {len(needing)} outputs"
                )
            if needing:
                torch.autograd.backward(needing, grads)
        if k > 0:
            back = [
                a.grad if a.grad is not None else torch.zeros_like(a) for a, w in zip(args, wants, strict=True) if w
            ]
            self.peers[(self.stage - 1) % self.stages].send(back, [False] * len(back), GRADIENT, (i, k))
