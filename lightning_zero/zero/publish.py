"""Step 5 of the data path, **publish**: updated slices back into whole parameters.

Stages 1 and 2 (and small, persistent parameters under stage 3) keep whole parameters on every rank. After the optimizer updated this rank's slice,
each flat buffer is all-gathered in place: the input is this rank's slice of ``flat_param`` and the
output is ``flat_param`` itself, so the parameters (views into it) are current again without an
extra copy. At most ``allgather_bucket_size`` elements are in flight at once.

Under stage 3 the updated slice only replaces ``param_shard``; :mod:`~lightning_zero.zero.gather`
gathers it before the module's next forward.

**Pipelined** (``OffloadConfig.pipeline``, DeepSpeed's pipelined offload): when the compiled kernels
step the slices (:mod:`~lightning_zero.zero.step_kernels`), a :class:`Publisher` is handed each buffer
the moment its step and 16-bit copy-back are issued, and starts its all-gather then, so buffer ``i``
travels while buffer ``i + 1`` is stepped on the host. Unpipelined, every buffer is stepped first and
:func:`publish` gathers them afterwards. The numbers are the same either way (each buffer's
all-gather reads only its own, already final, slice).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer

#: called with each buffer once its step and copy-back are issued, and the event that copy recorded
#: (a pipelined step's hand-off: :meth:`Publisher.send`)
Stepped = Callable[[FlatBuffer, "torch.cuda.Event | None"], None]


class Publisher:
    """Starts the all-gather of each buffer handed to :meth:`send`, at most ``max_in_flight``
    elements at once (the oldest is waited for first); :meth:`finish` sends the buffers not sent
    yet, in list order, and waits for all. Ranks must send in the same order (the step's order is
    the same on every rank). Call on all ranks."""

    def __init__(self, group: comm.ProcessGroup, max_in_flight: int) -> None:
        self.group = group
        self.max_in_flight = max_in_flight
        self.in_flight: deque[tuple[comm.Handle, int]] = deque()
        self.issued = 0
        self.sent: set[int] = set()

    def send(self, buffer: FlatBuffer, ready: torch.cuda.Event | None = None) -> None:
        """Start gathering ``buffer``'s updated slice into its ``flat_param``. ``ready``: the event
        recorded after the slice's host-to-device copy on a side stream (GPU, pipelined). A buffer
        already sent this step is not sent again."""
        if id(buffer) in self.sent:
            return
        self.sent.add(id(buffer))
        if not buffer.persistent:
            return  # stage 3: the updated shard is gathered when a module next needs it
        numel = buffer.layout.padded_numel
        while self.in_flight and self.issued + numel > self.max_in_flight:
            handle, done_numel = self.in_flight.popleft()
            handle.wait()
            self.issued -= done_numel
        if ready is not None:
            # The collective is queued behind the current stream: make that stream (not the host)
            # wait for this slice's copy-back on the side stream.
            torch.cuda.current_stream(buffer.param_shard.device).wait_event(ready)
        assert buffer.flat_param is not None  # persistent buffers always hold their full parameters
        handle = comm.all_gather(buffer.flat_param, buffer.param_shard, self.group, async_op=True)
        self.in_flight.append((handle, numel))
        self.issued += numel

    def finish(self, buffers: Iterable[FlatBuffer]) -> None:
        """Send every buffer of ``buffers`` not sent yet, then wait for all. Call on all ranks."""
        for buffer in buffers:
            if id(buffer) not in self.sent:
                self.send(buffer)
        while self.in_flight:
            self.in_flight.popleft()[0].wait()
        self.sent.clear()


def publish(buffers: list[FlatBuffer], group: comm.ProcessGroup, max_in_flight: int) -> None:
    """All-gather every buffer's updated slice into its full ``flat_param``; the step has already
    written ``param_shard`` (:meth:`ShardedOptimizer.step`). Call on all ranks."""
    Publisher(group, max_in_flight).finish(buffers)
