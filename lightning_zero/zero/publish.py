"""Step 5 of the data path, **publish**: updated slices back into whole parameters.

Stages 1 and 2 (and small, persistent parameters under stage 3) keep whole parameters on every rank. After the optimizer updated this rank's slice,
each flat buffer is all-gathered in place: the input is this rank's slice of ``flat_param`` and the
output is ``flat_param`` itself, so the parameters (views into it) are current again without an
extra copy. At most ``allgather_bucket_size`` elements are in flight at once.

Under stage 3 the updated slice only replaces ``param_shard``; :mod:`~lightning_zero.zero.gather`
gathers it before the module's next forward.
"""

from __future__ import annotations

from collections import deque

from lightning_zero import comm
from lightning_zero.zero.flat import FlatBuffer


def publish(buffers: list[FlatBuffer], group: comm.ProcessGroup, max_in_flight: int) -> None:
    """All-gather every buffer's updated slice into its full ``flat_param``; the step has already
    written ``param_shard`` (:meth:`ShardedOptimizer.step`). Call on all ranks."""
    in_flight: deque[tuple[comm.Handle, int]] = deque()
    issued = 0
    for buffer in buffers:
        if not buffer.persistent:
            continue  # stage 3: the updated shard is gathered when a module next needs it
        numel = buffer.layout.padded_numel
        while in_flight and issued + numel > max_in_flight:
            handle, done_numel = in_flight.popleft()
            handle.wait()
            issued -= done_numel
        assert buffer.flat_param is not None  # persistent buffers always hold their full parameters
        handle = comm.all_gather(buffer.flat_param, buffer.param_shard, group, async_op=True)
        in_flight.append((handle, numel))
        issued += numel
    while in_flight:
        in_flight.popleft()[0].wait()
