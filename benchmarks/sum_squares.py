"""The host sum of squares behind the global gradient norm: the compiled kernel against its references.

    python benchmarks/sum_squares.py [--numel 100M] [--threads 1,2] [--repeats 5]

``lightning_zero.zero.swap_grads.squared_norm`` takes the sum of squares of every gradient slice on
the host (the disk tier in backward, from the reduced bf16 slice; the in-memory path in the step,
from the fp32 ``master.grad``). Rows, per dtype (bf16, fp32) and thread count: the compiled op
(``torch.ops.lightning_zero.cpu_sum_squares``, the auto ISA path), the readable reference it
replaced (``lightning_zero.ops.reference.cpu_sum_squares``: chunks of 2^20 elements, a bf16 chunk
cast into an fp32 buffer, ``vector_norm`` per chunk), and one ``torch.linalg.vector_norm`` over the
whole tensor cast to fp32 (what the simplest code would do). ms is the best of ``--repeats``; GB/s
counts the input's bytes once; "x ref" is the reference's time over the row's. The 1-minute load
average is printed with the table: numbers taken under load are not comparable.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from lightning_zero.ops import functional as F
from lightning_zero.ops import reference


def _numel(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def _best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()  # warm: first-touch of any scratch memory, the dispatcher's caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", default="100M")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = _numel(args.numel)
    data = torch.randn(n, generator=torch.Generator().manual_seed(0))
    inputs = {"bf16": data.bfloat16(), "fp32": data}
    print(f"{n / 1e6:.0f}M elements, load average {os.getloadavg()[0]:.2f}, CPU path {F.cpu_path()}")
    print("dtype | threads | implementation | ms | GB/s | x ref | value")
    for dtype, x in inputs.items():
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            rows = {
                "compiled": lambda x=x: F.cpu_sum_squares(x),
                "reference (chunked)": lambda x=x: reference.cpu_sum_squares(x),
                "vector_norm(x.float())^2": lambda x=x: torch.linalg.vector_norm(x.float()).square(),
            }
            times = {name: _best_ms(fn, args.repeats) for name, fn in rows.items()}
            for name, fn in rows.items():
                gbs = x.numel() * x.element_size() / times[name] / 1e6
                ratio = times["reference (chunked)"] / times[name]
                print(
                    f"{dtype} | {threads} | {name} | {times[name]:.1f} | {gbs:.1f} | {ratio:.1f}x | {float(fn()):.6g}"
                )


if __name__ == "__main__":
    main()
