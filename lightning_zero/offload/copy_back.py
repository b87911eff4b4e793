"""The 16-bit copy-back of pipelined ZeRO-Offload: updated parameter slices from host to device.

The CPU step of a sub-group (one flat buffer's slice) writes its 16-bit parameters into a pinned host
staging buffer (:meth:`~lightning_zero.zero.step_kernels.KernelStep._param_copy`); :class:`CopyBack`
queues that slice's host-to-device copy on a side stream (``non_blocking`` from pinned memory: the
host returns at once) and records an event, so the copy of sub-group ``i`` and the all-gather behind
it (:class:`~lightning_zero.zero.publish.Publisher`) run while the host steps sub-group ``i + 1``, as
DeepSpeed's pipelined offload does. On a CPU-only machine the "device" is the host: the kernel writes
the parameter slice itself and nothing is copied here.

Stream rules (each is a device-side wait, never a host synchronization, except the staging reuse):

* the side stream first waits for the compute stream, so no copy overwrites parameters that queued
  work still reads;
* the all-gather of a slice waits for that slice's event (:meth:`Publisher.send`);
* at the end of the step the compute stream waits for the side stream, so everything after the step
  (stage-3 gathers, the next forward) sees the new parameters;
* before the host rewrites a staging buffer (the next step), it waits for the copy that read it.
"""

from __future__ import annotations

import torch


class CopyBack:
    """Host-to-device copies of updated parameter slices on one side stream per device."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        #: id of the staging (host) tensor -> the event recorded after the copy that reads it
        self.pending: dict[int, torch.cuda.Event] = {}
        self.started: set[torch.device] = set()

    def before_write(self, host: torch.Tensor) -> None:
        """Block until the last copy out of ``host`` is done, before the host writes it again."""
        event = self.pending.pop(host.data_ptr(), None)
        if event is not None:
            event.synchronize()  # long done in practice: a whole forward/backward ran since

    def copy(self, device_slice: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
        """Queue ``device_slice.copy_(host)`` on the side stream; returns the event recorded after it
        (None, and a plain copy, when ``device_slice`` is not on a CUDA device)."""
        device = device_slice.device
        if device.type != "cuda":
            device_slice.copy_(host)
            return None
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        if device not in self.started:
            stream.wait_stream(torch.cuda.current_stream(device))  # queued work may still read the parameters
            self.started.add(device)
        with torch.cuda.stream(stream):
            device_slice.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self.pending[host.data_ptr()] = event
        return event

    def end(self) -> None:
        """The compute streams wait for every copy of this step (device side; the host goes on)."""
        for device in self.started:
            torch.cuda.current_stream(device).wait_stream(self.streams[device])
        self.started.clear()
