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
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero.plan.opclass import op_rates

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


def interpolate(curve: Sequence[tuple[float, float]], size: float) -> float:
    """The rate of ``curve`` (``(size, rate)`` points in increasing size) at ``size``: between two
    points the time per unit (1 / rate) is linear in log(size), so a slow point weighs as much as the
    time it costs; outside them the nearest point's rate."""
    if size <= curve[0][0]:
        return curve[0][1]
    for (s0, r0), (s1, r1) in itertools.pairwise(curve):
        if size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0) if s1 > s0 else 1.0
            return 1 / ((1 - w) / r0 + w / r1)
    return curve[-1][1]


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
    without native bfloat16 arithmetic converts every element); used where ``elementwise`` has no
    curve for the dtype."""
    elementwise: Mapping[str, tuple[tuple[float, float], ...]] = dataclasses.field(default_factory=dict)
    """Measured element-wise rates by size: ``((bytes moved, bytes/s), ...)`` in increasing size, per
    ``"<dtype>"`` (an op that writes another tensor than it reads) and ``"<dtype> in place"`` (an op
    that writes what it reads: the optimizer step, accumulation). Between the sizes the time per
    byte is interpolated in log(bytes) (:func:`interpolate`), outside them the nearest rate is
    used: the caches shape the curve, not a formula. Fresh pages of new outputs cost
    ``fresh_bandwidth`` besides."""
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
    op_elements: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Elements/s of individual ops measured on their own, by ``"<op name> <dtype>"`` (activations
    that evaluate erf, tanh or exp per element, softmax, normalization, comparisons: on a CPU they
    cost more than their bytes); such an op costs at least its elements at this rate. Empty (a
    table's accelerator): bytes and FLOPs only."""
    op_flops: Mapping[str, tuple[tuple[float, float], ...]] = dataclasses.field(default_factory=dict)
    """FLOP/s of individual ops with FLOPs other than the matrix products of ``flops``, by
    ``"<op name> <dtype>"`` (a CPU's fused attention kernel), as ``((FLOPs per output element,
    FLOP/s), ...)`` in increasing order (an attention's is proportional to its length; interpolated
    in log as ``elementwise``)."""
    matmul_latency: float = 0.0
    """Seconds a matrix product costs beyond ``FLOPs / FLOP/s`` (its blocking and packing: small
    products reach a fraction of the peak)."""
    serial_overhead: bool = False
    """True: the per-op cost adds to the op's work (a CPU rank dispatches and computes on the same
    thread); False: an accelerator's launches run ahead of its kernels and an op costs the larger."""
    fresh_bandwidth: float = math.inf
    """Bytes/s at which an op's new output on fresh pages is first touched and given back (the OS maps
    and zeroes every page, and unmaps it when freed): host allocations at least as large as the C
    library's mmap threshold (:func:`~.timing.fresh_threshold`). Infinite: no cost (a GPU's caching
    allocator keeps its memory)."""
    threads: int = 0
    """Intra-op threads of each rank the rates were measured with (0: not measured, a table's)."""

    def __post_init__(self) -> None:
        rates = [*self.flops.values(), *self.dtype_bandwidth.values(), *self.op_elements.values()]
        rates += [rate for curve in self.op_flops.values() for _, rate in curve]
        rates += [rate for curve in self.elementwise.values() for _, rate in curve]
        rates += [self.memory_bandwidth, self.host_link, self.fresh_bandwidth]
        rates += [link.bandwidth for link in self.collectives.values()]
        negative = min(self.host_bandwidth, self.matmul_latency, self.op_overhead, self.nvme_read, self.nvme_write) < 0
        if not self.flops or min(rates) <= 0 or negative:
            raise ValueError(f"machine {self.name!r}: every rate must be positive ({self})")
        for key, curve in [*self.elementwise.items(), *self.op_flops.items()]:
            sizes = [size for size, _ in curve]
            if not curve or min(sizes) <= 0 or sizes != sorted(sizes):
                raise ValueError(
                    f"machine {self.name!r}: elementwise[{key!r}] needs (size, rate) points in increasing size"
                )
        if not 0 < self.efficiency <= 1 or not 0 <= self.overlap <= 1:
            raise ValueError(
                f"machine {self.name!r}: efficiency={self.efficiency} must be in (0, 1], overlap={self.overlap} in [0, 1]"
            )

    def matmul_rate(self, dtype: str) -> float:
        """Achieved FLOP/s of matrix products in ``dtype`` (float32's when the dtype is not listed)."""
        return self.flops.get(dtype, self.flops.get("float32", max(self.flops.values()))) * self.efficiency

    def bandwidth(self, dtype: str, nbytes: int = 0, in_place: bool = False) -> float:
        """Bytes/s of an element-wise op on ``dtype`` tensors moving ``nbytes`` on the device,
        writing what it reads (``in_place``) or another tensor. A dtype without a curve of its own
        (integers, bool) uses float32's: the same bytes through the same caches."""
        if dtype in self.dtype_bandwidth and not any(key.split(" ")[0] == dtype for key in self.elementwise):
            return self.dtype_bandwidth[dtype]
        kind = " in place" if in_place else ""
        for key in (dtype + kind, dtype, "float32" + kind, "float32"):
            if key in self.elementwise:
                return interpolate(self.elementwise[key], nbytes)
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


#: tensor sizes (elements) of the element-wise rates: from within the caches to beyond the allocator's
#: reuse of freed blocks (glibc serves allocations above 32 MiB with fresh pages)
_SIZES = (1 << 16, 1 << 20, 1 << 22, 1 << 23, 1 << 24)


def _linear_products(rows: int, width: int, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """The three matrix products of a Linear layer's forward and backward (``x @ W.T``, ``g @ W``,
    ``g.T @ x``: three memory layouts), as one function, and their FLOPs."""
    x, w, g = (torch.randn(*shape, dtype=dtype) for shape in ((rows, width), (width, width), (rows, width)))

    def products() -> None:
        torch.mm(x, w.t())
        torch.mm(g, w)
        torch.mm(g.t(), x)

    return products, 3 * 2.0 * rows * width * width


def _autograd_op_cost(seconds: float) -> float:
    """Seconds per dispatched op of a tiny module's forward and backward (tensors of a few elements:
    the work is nothing, what remains is the module call, the dispatch and autograd's bookkeeping
    that every op of a training step pays)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)

    def step() -> None:
        model(x).mean().backward()

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return 1 / _rate(step, Count.ops, seconds)


def _fresh_bandwidth(seconds: float) -> float:
    """Bytes/s of filling a new 64 MiB tensor (fresh pages: glibc maps blocks this large, and unmaps
    them when freed) beyond filling an existing one."""
    numel = 1 << 24
    existing = torch.empty(numel)
    fresh = 1 / _rate(lambda: torch.empty(numel).fill_(1.0), 1, seconds)
    reused = 1 / _rate(lambda: existing.fill_(1.0), 1, seconds)
    return 4.0 * numel / max(fresh - reused, 1e-9)


def _measure(rank: int, seconds: float, threads: int, nvme_path: str | None = None) -> dict[str, object]:
    """One rank's measurements (all ranks measure the same thing at the same moment)."""
    import torch.distributed as dist

    from lightning_zero import comm

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    try:
        group = dist.group.WORLD
        n = comm.world_size(group)
        step = seconds / 60  # about 55 steps in all, and the per-op rates' second or so
        out: dict[str, object] = {"threads": torch.get_num_threads()}
        flops: dict[str, float] = {}
        latency: list[float] = []
        curves: dict[str, list[tuple[float, float]]] = {}
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            # a transformer layer's products at a few hundred tokens; a tiny one gives the fixed cost
            products, work = _linear_products(256, 1024, dtype)
            comm.barrier(group)
            flops[name] = _rate(products, work, 3 * step)
            products, work = _linear_products(16, 64, dtype)
            latency.append(max(0.0, (1 / _rate(products, 1, step) - work / flops[name]) / 3))
            # one set of buffers, sliced for the smaller sizes (values do not matter to an add)
            buffers = [torch.full((_SIZES[-1],), 0.5, dtype=dtype) for _ in range(3)]
            for kind in ("", " in place"):
                points = []
                for numel in _SIZES:
                    x, y, z = (b[:numel] for b in buffers)
                    # the output exists (its pages are mapped): the fresh pages' cost is measured apart
                    add = functools.partial(torch.add, x, y, out=x if kind else z)
                    comm.barrier(group)
                    points.append((3.0 * x.element_size() * numel, _rate(add, 3.0 * x.element_size() * numel, step)))
                curves[name + kind] = points
            del buffers
        out["flops"], out["elementwise"] = flops, curves
        out["fresh_bandwidth"] = _fresh_bandwidth(step)
        out["op_elements"], out["op_flops"] = op_rates((torch.float32, torch.bfloat16), repeats=3)
        out["matmul_latency"] = statistics.mean(latency)
        comm.barrier(group)
        out["op_overhead"] = _autograd_op_cost(step)
        links = {}
        if n > 1:
            for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
                small, large = 4096 * n, 8 << 20
                t_small = 1 / _rate_together(_collective(op, small, group), 1, step, group)
                t_large = 1 / _rate_together(_collective(op, large, group), 1, 2 * step, group)
                per_byte = max((t_large - t_small) / (ring_bytes(op, large, n) - ring_bytes(op, small, n)), 1e-13)
                links[op] = (max(t_small - ring_bytes(op, small, n) * per_byte, 0.0), 1 / per_byte)
            out["overlap"] = _overlap(group, 3 * step)
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


def calibrate(world_size: int = 2, seconds: float = 4.0, threads: int = 1, nvme_path: str | None = None) -> Machine:
    """Measure this machine as ``world_size`` CPU ranks (gloo, ``threads`` intra-op threads each: 1,
    as the tests and benchmarks run them) see it, in a few times ``seconds``, all ranks at once so
    that they share the cores and the memory as in training. Each op class of a step is measured on
    a micro-benchmark of its own: matrix products (a Linear layer's three, at a layer's size and a
    tiny one for the fixed cost) in float32 and bfloat16; element-wise ops by dtype and size, writing
    a new tensor or into an existing one; activations, softmax, normalization, a comparison and the
    attention kernel, forward and backward, each op on its own (:func:`~.opclass.op_rates`); the cost of one op of a tiny
    module's forward and backward (dispatch and autograd); each collective's latency and bandwidth
    as :mod:`lightning_zero.comm` runs it on gloo; how much of an all-reduce hides under compute.
    Rates are the mean over ranks; latency and bandwidth those of rank 0. ``nvme_path``: also each
    rank's NVMe read and write rates, all ranks writing and reading swap files there at once for
    about a second (:func:`lightning_zero.plan.disk.measure_disk`)."""
    if world_size < 1 or seconds <= 0 or threads < 1:
        raise ValueError(
            f"calibrate(world_size={world_size}, seconds={seconds}, threads={threads}): all must be positive."
        )
    from lightning_zero.testing import run_ranks

    results = run_ranks(
        _measure,
        seconds,
        threads,
        nvme_path,
        world_size=world_size,
        timeout=60 + 10 * seconds,
        run_id="lightning_zero_calibrate",
    )
    first = results[0]

    def mean(key: str) -> dict[str, float]:
        # over the ranks that measured it (an op a rank timed too fast to keep is left out there)
        return {k: statistics.mean(r[key][k] for r in results if k in r[key]) for k in first[key]}

    links = {op: Link(latency=lat, bandwidth=bw) for op, (lat, bw) in first["collectives"].items()}
    if not links:  # one rank: no collective runs, any positive rate will do
        links = {"all_reduce": Link(latency=0.0, bandwidth=math.inf)}
    curves = {
        key: tuple(
            (size, statistics.mean(r["elementwise"][key][i][1] for r in results)) for i, (size, _) in enumerate(points)
        )
        for key, points in first["elementwise"].items()
    }
    in_cache = {key: curve[0][1] for key, curve in curves.items() if " " not in key}
    return Machine(
        name=f"this machine ({os.cpu_count()} cores), {world_size} gloo ranks",
        flops=mean("flops"),
        memory_bandwidth=in_cache["float32"],
        dtype_bandwidth=in_cache,
        elementwise=curves,
        collectives=links,
        host_bandwidth=in_cache["float32"],
        op_overhead=statistics.mean(float(r["op_overhead"]) for r in results),
        fresh_bandwidth=statistics.mean(float(r["fresh_bandwidth"]) for r in results),
        efficiency=1.0,
        overlap=float(first.get("overlap", 1.0)),
        source=f"calibrated on {world_size} ranks",
        nvme_read=statistics.mean(r["nvme"][0] for r in results) if nvme_path is not None else 0.0,
        nvme_write=statistics.mean(r["nvme"][1] for r in results) if nvme_path is not None else 0.0,
        op_elements=mean("op_elements"),
        op_flops={
            key: tuple(
                (size, statistics.mean(dict(r["op_flops"].get(key, curve)).get(size, rate) for r in results))
                for size, rate in curve
            )
            for key, curve in first["op_flops"].items()
        },
        matmul_latency=statistics.mean(float(r["matmul_latency"]) for r in results),
        serial_overhead=True,
        threads=int(first["threads"]),
    )


def to_dict(machine: Machine) -> dict[str, object]:
    """The machine as JSON-able values (for a results file)."""
    values = dataclasses.asdict(machine)
    values["collectives"] = {op: dataclasses.asdict(link) for op, link in machine.collectives.items()}
    return values


__all__ = [
    "DEVICES",
    "INTERCONNECTS",
    "NVME",
    "OPS",
    "Link",
    "Machine",
    "calibrate",
    "interpolate",
    "known",
    "ring_bytes",
    "to_dict",
]
