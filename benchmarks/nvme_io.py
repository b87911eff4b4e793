"""The disk tier's I/O engines alone: bytes through a SwapStore, as a fraction of the disk.

    python benchmarks/nvme_io.py --nvme-path /tmp/lz_io [--gib 4] [--tensor-mib 64] [--engines io_uring,threads,python]

1. The disk under ``--nvme-path``, measured first by this script (``capacity.measure_disk``:
   O_DIRECT, 1 MiB aligned blocks, one request at a time, as ``dd oflag=direct``), GB/s.
2. For each engine, with and without a CPU-busy thread beside it (``torch.mm`` of 1024x1024 fp32 in
   a loop on torch's intra-op threads: the step's compute, which in the capacity run shares the 2
   cores with the I/O): ``--gib`` GiB written through :class:`SwapStore` (``--tensor-mib`` tensors,
   at most ``--window`` in memory, as the step's sub-groups; allocated by the store, so 4096-aligned
   under the compiled engines), fsync'd, dropped from the page cache (``POSIX_FADV_DONTNEED``, so
   the Python engine's reads come from the disk too), then read back the same way. GB/s of each
   phase, its fraction of the disk's rate ("x disk"), the busy thread's matmul rate next to its
   rate alone (what the I/O costs the compute), and without it the process's CPU seconds (user +
   system, the kernel's io_uring workers included) per GB moved. First, the CPU cost of the
   allocations alone (:func:`allocation_cost`).

The swap directory is removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the path set-up, as the other benchmarks)

from benchmarks.capacity import measure_disk  # noqa: E402
from lightning_zero.config import NvmeConfig  # noqa: E402
from lightning_zero.offload.nvme import SwapStore  # noqa: E402


class Busy:
    """A thread multiplying 1024x1024 fp32 matrices until stopped; ``rate()``: GFLOP/s achieved."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        while not self._stop.is_set():
            torch.mm(a, b)  # releases the GIL: the I/O threads' Python parts still run
            self.count += 1

    def __enter__(self) -> Busy:
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.start

    def rate(self) -> float:
        return self.count * 2 * 1024**3 / self.seconds / 1e9


def push(store: SwapStore, count: int, numel: int, window: int) -> tuple[float, float]:
    """Write ``count`` tensors of ``numel`` fp32 through ``store`` and read them back, at most
    ``window`` in memory: seconds of the write phase (fsync included) and of the read phase."""
    tensors = [torch.empty(numel) for _ in range(count)]
    for t in tensors:
        t.untyped_storage().resize_(0)
    items = [(f"t{i}", t) for i, t in enumerate(tensors)]
    start = time.perf_counter()
    for i, item in enumerate(items):
        store.allocate(item[1])
        item[1].fill_(float(i))  # memset-speed: what is written does not matter to the disk
        store.evict([item])
        if i >= window:
            store.release([items[i - window]])
    store.release(items[max(0, count - window) :])
    fds = [os.open(store.directory / f"{name}.swp", os.O_RDONLY) for name, _ in items]
    for fd in fds:
        os.fsync(fd)  # the Python engine wrote into the page cache: its writes end on the disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # and its reads start from the disk
        os.close(fd)
    write = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(min(window, count)):
        store.fetch([items[i]])
    for i, item in enumerate(items):
        store.wait([item])
        assert item[1][-1].item() == float(i), "read back the wrong bytes"
        item[1].untyped_storage().resize_(0)
        if i + window < count:
            store.fetch([items[i + window]])
    read = time.perf_counter() - start
    return write, read


def allocation_cost(numel: int, count: int) -> dict[str, float]:
    """CPU seconds per GB to give a zero-byte tensor memory, fill it and free it again (what the tier
    does to every buffer it reads or writes, every step): torch's allocator (``resize_``) against the
    store's aligned one (``host_alloc_aligned``: 2 MiB-aligned with ``MADV_HUGEPAGE`` from 8 MiB)."""
    tensor = torch.empty(numel)
    tensor.untyped_storage().resize_(0)
    out = {}
    for how in ("torch", "aligned"):
        before = os.times()
        for i in range(count):
            if how == "aligned":
                torch.ops.lightning_zero.host_alloc_aligned(tensor)
            else:
                tensor.untyped_storage().resize_(numel * 4)
            tensor.fill_(float(i))
            tensor.untyped_storage().resize_(0)
        after = os.times()
        out[how] = (after.user - before.user + after.system - before.system) / (count * numel * 4 / 1e9)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--gib", type=float, default=4.0, help="GiB written, then read, per engine and mode")
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--window", type=int, default=4, help="tensors in memory at once")
    parser.add_argument("--disk-mib", type=int, default=1024)
    parser.add_argument("--engines", default="io_uring,threads,python")
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    numel = args.tensor_mib << 18  # fp32 elements
    count = max(1, round(args.gib * 1024 / args.tensor_mib))
    gb = count * numel * 4 / 1e9
    try:
        print(f"uptime load: {os.getloadavg()}; torch threads {torch.get_num_threads()}; cores {os.cpu_count()}")
        disk = measure_disk(args.nvme_path, args.disk_mib)
        print(
            f"disk under {args.nvme_path}: O_DIRECT 1 MiB blocks, one at a time: write {disk['write_gbs']:.3f} GB/s, "
            f"read {disk['read_gbs']:.3f} GB/s"
        )
        with Busy() as alone:
            time.sleep(3)
        print(f"busy thread alone: {alone.rate():.1f} GFLOP/s")
        if hasattr(torch.ops.lightning_zero, "host_alloc_aligned"):
            cost = allocation_cost(numel, 16)
            print(
                f"allocate + fill + free {args.tensor_mib} MiB tensors, CPU s per GB: torch's allocator "
                f"{cost['torch']:.2f}, the store's aligned one {cost['aligned']:.2f}"
            )
        print(
            f"{count} tensors x {args.tensor_mib} MiB = {gb:.2f} GB written then read; block {args.block_size}, "
            f"queue_depth {args.queue_depth}, threads {args.threads}, window {args.window}"
        )
        print(
            "engine | CPU-busy thread | write GB/s (x disk) | read GB/s (x disk) | busy GFLOP/s (x alone) | "
            "CPU s per GB moved | load"
        )
        for engine in args.engines.split(","):
            for busy in (False, True):
                config = NvmeConfig(
                    path=args.nvme_path,
                    block_size=args.block_size,
                    queue_depth=args.queue_depth,
                    threads=args.threads,
                    aio_engine=engine,
                )
                store = SwapStore(config, rank=0)
                cpu = os.times()
                try:
                    if busy:
                        with Busy() as b:
                            write, read = push(store, count, numel, args.window)
                        flops = f"{b.rate():.1f} ({b.rate() / alone.rate():.2f})"
                    else:
                        write, read = push(store, count, numel, args.window)
                        flops = "-"
                finally:
                    store.close(bring_back=False)
                after = os.times()
                cpu_s = after.user - cpu.user + after.system - cpu.system
                w, r = gb / write, gb / read
                print(
                    f"{store.engine} | {'yes' if busy else 'no'} | {w:.3f} ({w / disk['write_gbs']:.2f}) | "
                    f"{r:.3f} ({r / disk['read_gbs']:.2f}) | {flops} | "
                    f"{'-' if busy else f'{cpu_s / (2 * gb):.2f}'} | {os.getloadavg()[0]:.2f}"
                )
    finally:
        shutil.rmtree(args.nvme_path, ignore_errors=True)
        print(f"removed {args.nvme_path}: {not os.path.exists(args.nvme_path)}")


if __name__ == "__main__":
    main()
