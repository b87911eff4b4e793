"""The machine a plan is timed on: its rates (FLOP/s per dtype, memory bandwidth, the collectives'
latency and bandwidth, host memory and the host link), from a small table of known accelerators and
interconnects (:data:`DEVICES`, :data:`INTERCONNECTS`) or measured here (:func:`calibrate`).

The table holds datasheet peaks; ``efficiency`` says how much of the peak FLOP/s a training step's
matrix products reach (0.5 by default for the table, a typical figure for large models, not measured
here). :func:`calibrate` measures this machine with the ranks it will run: every rank times its own
matrix products, element-wise ops and the engine's collectives at the same moment, so the sharing
of cores and memory between ranks is in the rates (``efficiency`` is then 1: the rates are achieved
ones).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

#: the collective operations the time model knows, as :mod:`lightning_zero.comm` names them
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", "barrier")


def ring_bytes(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for one collective over a whole buffer of ``nbytes`` (ring algorithms):
    all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N, broadcast and point-to-point 1."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * nbytes
    if op == "barrier":
        return 0.0
    return float(nbytes)


@dataclass(frozen=True)
class Link:
    """One collective's cost: ``latency + ring_bytes / bandwidth`` seconds."""

    latency: float
    """Seconds per call (start-up, one small message)."""
    bandwidth: float
    """Bytes per second one rank sends (the ring's per-rank rate)."""

    def seconds(self, op: str, nbytes: int, world_size: int) -> float:
        """Seconds of one ``op`` over a whole buffer of ``nbytes`` on ``world_size`` ranks."""
        return self.latency + ring_bytes(op, nbytes, world_size) / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """Rates of one rank's device, its host and the data-parallel interconnect."""

    name: str
    flops: Mapping[str, float]
    """Matrix-product FLOP/s by dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``)."""
    memory_bandwidth: float
    """Bytes/s of element-wise ops on the device."""
    collectives: Mapping[str, Link]
    """Per :data:`OPS` name; a missing one uses ``"all_reduce"``'s."""
    dtype_bandwidth: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Bytes/s of element-wise ops by dtype name where it differs from ``memory_bandwidth`` (a CPU
    without native bfloat16 arithmetic converts every element)."""
    cache_bytes: int = 0
    """Ops moving more bytes than this run at ``large_bandwidth`` (a CPU's caches hold smaller ones);
    0: one bandwidth for every size."""
    large_bandwidth: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Bytes/s by dtype name of element-wise ops larger than ``cache_bytes``."""
    host_bandwidth: float = 0.0
    """Bytes/s of element-wise ops in host memory (the offloaded optimizer step); 0: the device's."""
    host_link: float = math.inf
    """Bytes/s between host and device memory (PCIe); infinite when the device is the host."""
    op_overhead: float = 5e-6
    """Seconds every op costs at least (dispatch, kernel launch)."""
    efficiency: float = 1.0
    """Fraction of ``flops`` a step's matrix products reach."""
    overlap: float = 1.0
    """Fraction of communication that can run while the rank computes: 1 with separate copy engines
    and NICs (a GPU); measured on CPU ranks, whose collectives share the cores with the compute."""
    source: str = "table"
    """``"table"`` or ``"calibrated on N ranks"``."""
    nvme_read: float = 0.0
    """Bytes/s one rank reads from its NVMe swap files (the ranks of a node share its drives); 0:
    unknown (a plan with the NVMe tiers then cannot be timed on this machine)."""
    nvme_write: float = 0.0
    """Bytes/s one rank writes to its NVMe swap files; 0: unknown."""

    def __post_init__(self) -> None:
        rates = [*self.flops.values(), *self.dtype_bandwidth.values(), *self.large_bandwidth.values()]
        rates += [self.memory_bandwidth, self.host_link]
        rates += [link.bandwidth for link in self.collectives.values()]
        if not self.flops or min(rates) <= 0 or min(self.host_bandwidth, self.nvme_read, self.nvme_write) < 0:
            raise ValueError(f"machine {self.name!r}: every rate must be positive ({self})")
        if not 0 < self.efficiency <= 1 or not 0 <= self.overlap <= 1:
            raise ValueError(
                f"machine {self.name!r}: efficiency={self.efficiency} must be in (0, 1], overlap={self.overlap} in [0, 1]"
            )

    def matmul_rate(self, dtype: str) -> float:
        """Achieved FLOP/s of matrix products in ``dtype`` (float32's when the dtype is not listed)."""
        return self.flops.get(dtype, self.flops.get("float32", max(self.flops.values()))) * self.efficiency

    def bandwidth(self, dtype: str, nbytes: int = 0) -> float:
        """Bytes/s of an element-wise op on ``dtype`` tensors moving ``nbytes`` on the device."""
        if self.cache_bytes and nbytes > self.cache_bytes and dtype in self.large_bandwidth:
            return self.large_bandwidth[dtype]
        return self.dtype_bandwidth.get(dtype, self.memory_bandwidth)

    def link(self, op: str) -> Link:
        """The cost of ``op`` on the data-parallel group."""
        return self.collectives.get(op) or self.collectives["all_reduce"]


#: Datasheet peaks (dense, no sparsity) of one accelerator; fp32 without TF32 (torch's default for
#: matrix products), host link PCIe at about 80% of its nominal rate.
DEVICES: dict[str, dict[str, object]] = {
    "H100": {
        "flops": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        "memory_bandwidth": 3.35e12,
        "memory_bytes": 80 * 2**30,
        "host_link": 50e9,  # PCIe 5.0 x16
        "interconnect": "nvlink4",
    },
    "H200": {
        "flops": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        "memory_bandwidth": 4.8e12,
        "memory_bytes": 141 * 2**30,
        "host_link": 50e9,
        "interconnect": "nvlink4",
    },
    "A100": {
        "flops": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        "memory_bandwidth": 2.0e12,
        "memory_bytes": 80 * 2**30,
        "host_link": 25e9,  # PCIe 4.0 x16
        "interconnect": "nvlink3",
    },
}
#: Per-rank bandwidth (bytes/s, one direction) and latency (s) of a data-parallel interconnect.
INTERCONNECTS: dict[str, Link] = {
    "nvlink4": Link(latency=10e-6, bandwidth=450e9),
    "nvlink3": Link(latency=10e-6, bandwidth=300e9),
    "ib-ndr400": Link(latency=20e-6, bandwidth=50e9),
    "ib-hdr200": Link(latency=20e-6, bandwidth=25e9),
    "ethernet-100g": Link(latency=50e-6, bandwidth=12.5e9),
}


#: Per-rank NVMe rates (bytes/s) assumed for the table's machines: a node's array of data-center
#: PCIe 4.0 drives at about 25 GB/s sequential read and 12 GB/s write, shared by its 8 ranks (an
#: assumption, not measured; ``calibrate(nvme_path=...)`` measures a disk).
NVME = {"read": 3.1e9, "write": 1.5e9}


def known(device: str, interconnect: str | None = None, efficiency: float = 0.5) -> Machine:
    """A :class:`Machine` from the table: ``device`` in :data:`DEVICES`, ``interconnect`` in
    :data:`INTERCONNECTS` (default: the device's NVLink, for ranks within one node)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not in the table {sorted(DEVICES)}; calibrate or give a Machine.")
    spec = DEVICES[device]
    interconnect = interconnect or str(spec["interconnect"])
    if interconnect not in INTERCONNECTS:
        raise ValueError(f"interconnect {interconnect!r} is not in the table {sorted(INTERCONNECTS)}.")
    return Machine(
        name=f"{device} over {interconnect}",
        flops=dict(spec["flops"]),  # type: ignore[call-overload]
        memory_bandwidth=float(spec["memory_bandwidth"]),  # type: ignore[arg-type]
        collectives={"all_reduce": INTERCONNECTS[interconnect]},
        host_bandwidth=100e9,  # a two-socket server's DRAM, shared by the node's ranks
        host_link=float(spec["host_link"]),  # type: ignore[arg-type]
        op_overhead=5e-6,
        efficiency=efficiency,
        overlap=1.0,
        nvme_read=NVME["read"],
        nvme_write=NVME["write"],
    )


# -- calibration on this machine ------------------------------------------------------------------


def _rate(fn: Callable[[], object], work: float, seconds: float) -> float:
    """``work`` units per second of ``fn``, the median of a few timed runs of about ``seconds`` in all."""
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 3:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return work / statistics.median(samples)


def _rate_together(fn: Callable[[], object], work: float, seconds: float, group: object) -> float:
    """:func:`_rate` of a function every rank of ``group`` calls together (a collective): the ranks
    agree on how many times (the fewest any of them would fit in ``seconds``), so none waits alone."""
    from lightning_zero import comm

    fn()
    start = time.perf_counter()
    fn()
    count = torch.tensor([max(3, int(seconds / max(time.perf_counter() - start, 1e-6)))])
    comm.all_reduce(count, group, op=torch.distributed.ReduceOp.MIN)  # type: ignore[arg-type]
    samples: list[float] = []
    for _ in range(int(count.item())):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return work / statistics.median(samples)


def _collective(op: str, nbytes: int, group: object) -> Callable[[], object]:
    from lightning_zero import comm

    n = comm.world_size(group)  # type: ignore[arg-type]
    numel = max(n, nbytes // 4 // n * n)
    full = torch.zeros(numel)
    shard = torch.zeros(numel // n)
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: comm.all_reduce(full, group),  # type: ignore[arg-type]
        # as the engine reduces its buckets on gloo
        "reduce_scatter": lambda: comm.reduce_scatter(shard, full, group, clobber_input=True),  # type: ignore[arg-type]
        "all_gather": lambda: comm.all_gather(full, shard, group, async_op=True).wait(),  # type: ignore[arg-type]
        "broadcast": lambda: comm.broadcast(full, 0, group),  # type: ignore[arg-type]
    }
    return calls[op]


def _measure(rank: int, seconds: float, nvme_path: str | None = None) -> dict[str, object]:
    """One rank's measurements (all ranks measure the same thing at the same moment)."""
    import torch.distributed as dist

    from lightning_zero import comm

    dist.init_process_group("gloo")
    try:
        group = dist.group.WORLD
        n = comm.world_size(group)
        step = seconds / 12
        out: dict[str, object] = {}
        flops: dict[str, float] = {}
        bandwidth: dict[str, float] = {}
        beyond: dict[str, float] = {}
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            # a product of the size of a transformer layer's at a few hundred tokens
            a, b = torch.randn(512, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
            comm.barrier(group)
            flops[name] = _rate(functools.partial(torch.matmul, a, b), 2 * 512 * 1024 * 1024, step)
            # about an activation's size at a few hundred tokens: the element-wise ops of a step
            x, y = torch.randn(1 << 20, dtype=dtype), torch.randn(1 << 20, dtype=dtype)
            comm.barrier(group)
            bandwidth[name] = _rate(functools.partial(torch.add, x, y), 3 * x.element_size() * x.numel(), step)
            # and beyond the caches (a language model's logits and their gradient)
            x, y = torch.randn(1 << 23, dtype=dtype), torch.randn(1 << 23, dtype=dtype)
            comm.barrier(group)
            beyond[name] = _rate(functools.partial(torch.add, x, y), 3 * x.element_size() * x.numel(), step)
        out["flops"], out["bandwidth"], out["large"] = flops, bandwidth, beyond
        tiny = torch.zeros(4)
        out["op_overhead"] = 1 / _rate(lambda: tiny.add_(1), 1, step / 2)
        links = {}
        if n > 1:
            for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
                small, large = 4096 * n, 8 << 20
                t_small = 1 / _rate_together(_collective(op, small, group), 1, step / 2, group)
                t_large = 1 / _rate_together(_collective(op, large, group), 1, step, group)
                per_byte = max((t_large - t_small) / (ring_bytes(op, large, n) - ring_bytes(op, small, n)), 1e-13)
                links[op] = (max(t_small - ring_bytes(op, small, n) * per_byte, 0.0), 1 / per_byte)
            out["overlap"] = _overlap(group, step)
        out["collectives"] = links
        if nvme_path is not None:  # every rank at once: they share the disk
            from lightning_zero.plan.disk import measure_disk

            comm.barrier(group)
            out["nvme"] = measure_disk(nvme_path, seconds=1.0)
        return out
    finally:
        dist.destroy_process_group()


def _overlap(group: object, seconds: float) -> float:
    """How much of an all-reduce hides under matrix products running beside it, 0 to 1."""
    from lightning_zero import comm

    full = torch.zeros(8 << 20 >> 2)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    reduce_time = 1 / _rate_together(lambda: comm.all_reduce(full, group), 1, seconds, group)  # type: ignore[arg-type]
    count = max(1, int(reduce_time * _rate(lambda: a @ b, 1, seconds)))

    def compute() -> None:
        for _ in range(count):
            a @ b

    compute_time = 1 / _rate_together(compute, 1, seconds, group)

    def both() -> None:
        handle = comm.all_reduce(full, group, async_op=True)  # type: ignore[arg-type]
        compute()
        handle.wait()

    both_time = 1 / _rate_together(both, 1, seconds, group)
    hidden = compute_time + reduce_time - both_time
    return min(1.0, max(0.0, hidden / min(compute_time, reduce_time)))


def calibrate(world_size: int = 2, seconds: float = 4.0, nvme_path: str | None = None) -> Machine:
    """Measure this machine as ``world_size`` CPU ranks (gloo, one thread each, as the tests and
    benchmarks run them) see it, in about ``seconds``: every rank's matrix-product FLOP/s in float32
    and bfloat16, element-wise bandwidth, the cost of one op, each collective's latency and bandwidth
    as :mod:`lightning_zero.comm` runs it on gloo, and how much of an all-reduce hides under compute.
    Rates are the mean over ranks; latency and bandwidth those of rank 0. ``nvme_path``: also each
    rank's NVMe read and write rates, all ranks writing and reading swap files there at once for
    about a second (:func:`lightning_zero.plan.disk.measure_disk`)."""
    if world_size < 1 or seconds <= 0:
        raise ValueError(f"calibrate(world_size={world_size}, seconds={seconds}): both must be positive.")
    from lightning_zero.testing import run_ranks

    results = run_ranks(
        _measure,
        seconds,
        nvme_path,
        world_size=world_size,
        timeout=60 + 10 * seconds,
        run_id="lightning_zero_calibrate",
    )
    first = results[0]
    flops = {k: statistics.mean(r["flops"][k] for r in results) for k in first["flops"]}
    links = {op: Link(latency=lat, bandwidth=bw) for op, (lat, bw) in first["collectives"].items()}
    if not links:  # one rank: no collective runs, any positive rate will do
        links = {"all_reduce": Link(latency=0.0, bandwidth=math.inf)}
    bandwidths = {k: statistics.mean(r["bandwidth"][k] for r in results) for k in first["bandwidth"]}
    large = {k: statistics.mean(r["large"][k] for r in results) for k in first["large"]}
    return Machine(
        name=f"this machine ({os.cpu_count()} cores), {world_size} gloo ranks",
        flops=flops,
        memory_bandwidth=bandwidths["float32"],
        dtype_bandwidth=bandwidths,
        # the in-cache measurement moved 3 x 1M float32 elements
        cache_bytes=12 << 20,
        large_bandwidth=large,
        collectives=links,
        host_bandwidth=bandwidths["float32"],
        op_overhead=statistics.mean(float(r["op_overhead"]) for r in results),
        efficiency=1.0,
        overlap=float(first.get("overlap", 1.0)),
        source=f"calibrated on {world_size} ranks",
        nvme_read=statistics.mean(r["nvme"][0] for r in results) if nvme_path is not None else 0.0,
        nvme_write=statistics.mean(r["nvme"][1] for r in results) if nvme_path is not None else 0.0,
    )


def to_dict(machine: Machine) -> dict[str, object]:
    """The machine as JSON-able values (for a results file)."""
    values = dataclasses.asdict(machine)
    values["collectives"] = {op: dataclasses.asdict(link) for op, link in machine.collectives.items()}
    return values


__all__ = ["DEVICES", "INTERCONNECTS", "NVME", "OPS", "Link", "Machine", "calibrate", "known", "ring_bytes", "to_dict"]
