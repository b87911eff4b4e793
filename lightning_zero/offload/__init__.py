"""ZeRO-Offload: fp32 master weights, gradient slices and optimizer states in host memory, and the
optimizer step on the CPU with the ``lightning_zero.ops`` kernels (``host.py``: pinned buffers;
``cpu_step.py``: the step). Enabled through ``OffloadPrecision(offload_optimizer=True, ...)`` or the
strategy's arguments / the ``zero2_offload`` and ``zero3_offload`` names.
"""
