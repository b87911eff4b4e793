"""Adagrad and Lion host steps: our one-pass kernels against torch and the references.

    python benchmarks/cpu_adagrad_lion.py [--size 20M] [--threads 1,2] [--repeats 3]

Adagrad: ours (each ISA path) against torch.optim.Adagrad(fused=True), torch's own fused CPU
kernel, and foreach=True. Lion: torch has none, so ours against the readable PyTorch reference
(``ops.reference.cpu_lion_step``, several passes over memory). Both read param, grad, one state and
write param and the state: 20 bytes per parameter, which GB/s counts. Best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from lightning_zero.ops import functional as F
from lightning_zero.ops import reference
from lightning_zero.ops._load import ISA_ENV, supported_isas

BYTES = 20


def timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def rows(n: int, repeats: int) -> list[tuple[str, float, float]]:
    """(what, seconds, baseline seconds) for every implementation."""
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    out = []
    for kw in ({"fused": True}, {"foreach": True}):
        param = torch.nn.Parameter(p.clone())
        param.grad = g
        opt = torch.optim.Adagrad([param], lr=1e-2, **kw)
        out.append((f"Adagrad torch {next(iter(kw))}=True", timed(opt.step, repeats)))
    for isa in supported_isas():
        os.environ[ISA_ENV] = isa
        q, s = p.clone(), torch.zeros(n)
        step = [0]

        def adagrad(q=q, s=s, step=step):
            step[0] += 1
            F.cpu_adagrad_step(q, g, s, lr=1e-2, lr_decay=0.0, eps=1e-10, weight_decay=0.0, step=step[0])

        out.append((f"Adagrad ours {isa}", timed(adagrad, repeats)))
    q, m = p.clone(), torch.zeros(n)
    out.append(
        (
            "Lion reference (torch ops)",
            timed(lambda: reference.cpu_lion_step(q, g, m, None, 1e-4, 0.9, 0.99, 0.1, 1.0), repeats),
        )
    )
    for isa in supported_isas():
        os.environ[ISA_ENV] = isa
        q, m = p.clone(), torch.zeros(n)
        out.append(
            (
                f"Lion ours {isa}",
                timed(
                    lambda q=q, m=m: F.cpu_lion_step(q, g, m, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1), repeats
                ),
            )
        )
    os.environ.pop(ISA_ENV, None)
    base = {"Adagrad": out[0][1], "Lion": out[len(supported_isas()) + 2][1]}
    return [(what, t, base[what.split()[0]]) for what, t in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="20M", help="parameters, M = 1e6")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = int(float(args.size.rstrip("M")) * 1e6)
    print(f"size={args.size} isas={supported_isas()} torch={torch.__version__} load={os.getloadavg()}")
    print(f"{'threads':>7} {'what':<30} {'ms':>9} {'GB/s':>7} {'vs baseline':>12}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for what, t, ref in rows(n, args.repeats):
            print(f"{threads:>7} {what:<30} {t * 1e3:9.1f} {BYTES * n / t / 1e9:7.1f} {ref / t:11.2f}x")
    print("baseline: torch Adagrad fused=True for Adagrad rows, the reference for Lion rows")


if __name__ == "__main__":
    main()
