"""CPU Adam step throughput against torch, DeepSpeed (if installed) and the memory bandwidth.

    python benchmarks/cpu_adam.py [--sizes 50M,100M] [--threads 1,2,all] [--repeats 5] [--plot scaling.png]

Every table is measured once per thread count in ``--threads`` (``all`` = the cores in this
process's affinity mask), then a thread-scaling table compares them: each row's "vs torch" is
against torch's fused AdamW at the same thread count, "vs DS" against DeepSpeedCPUAdam at the same
thread count (when deepspeed imports; it runs with ``DS_ACCELERATOR=cpu``, set here), "of bw" is
the row's GB/s over the ``a += b`` bandwidth of the same size and thread count, and "x own 1T" is
the speed-up over the same implementation at the first thread count listed. The 1-minute load
average is printed beside every table: on a shared machine, numbers taken under load are not
comparable (run it twice to see how stable they are). ``--plot`` needs matplotlib (the ``bench``
extra; not a dependency): ms per step and GB/s against threads, with the bandwidth for reference.

An Adam step is memory bound: it reads param, grad, exp_avg, exp_avg_sq (4 x 4 bytes) and writes
param, exp_avg, exp_avg_sq (3 x 4 bytes): 28 bytes per parameter. GB/s below is those bytes over
the measured time, so a step that reaches the machine's bandwidth (measured in the same run with a
STREAM-like in-place add, 12 bytes per element) cannot go faster without moving fewer bytes.

The "fused pass" rows do the work of an offloaded mixed-precision step: unscale x clip the
gradient, step, write a bf16 copy of the parameters for the device. Ours does it in one pass
(28 + 2 bytes per parameter); torch needs grad.mul_, the fused AdamW step, and a copy (the bytes
those passes move are counted as the same 30 so the times compare directly).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeedCPUAdam's rows on a machine without a GPU

from lightning_zero.ops import functional as F  # noqa: E402 (after DS_ACCELERATOR, read at deepspeed's import)
from lightning_zero.ops._load import ISA_ENV, supported_isas  # noqa: E402

ADAM_BYTES = 28
FUSED_BYTES = 30


def timed(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best of ``repeats`` for each of ``fns`` (after one warm-up each), run round-robin: on a shared
    machine a busy moment then hits every implementation alike, and the best time of each is the
    least disturbed one."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bandwidth_step(n: int) -> Callable[[], None]:
    """The STREAM-like reference: ``a += b`` over ``n`` fp32 elements (12 bytes per element)."""
    a, b = torch.ones(n), torch.ones(n)
    return lambda: a.add_(b)


def ours(p, g, isa, fused_pass=False) -> Callable[[], None]:
    """One step of our kernel on ``isa`` (states of its own; ``p`` and ``g`` shared)."""
    n = p.numel()
    m, v = torch.zeros(n), torch.zeros(n)
    copy = torch.empty(n, dtype=torch.bfloat16) if fused_pass else None
    state = {"step": 0}

    def step():
        os.environ[ISA_ENV] = isa  # read at every call: the implementations take turns
        state["step"] += 1
        F.cpu_adam_step(
            p,
            g,
            m,
            v,
            lr=1e-4,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            step=state["step"],
            grad_scale=0.5 if fused_pass else 1.0,
            param_copy=copy,
        )

    return step


def torch_adamw(p, g, fused_pass=False, **kw) -> Callable[[], None]:
    param = torch.nn.Parameter(p)
    opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, **kw)
    copy = torch.empty(p.numel(), dtype=torch.bfloat16) if fused_pass else None
    param.grad = torch.empty_like(g) if fused_pass else g

    def step():
        if fused_pass:
            torch.mul(g, 0.5, out=param.grad)  # the unscale pass, into a preallocated buffer
        opt.step()
        if fused_pass:
            copy.copy_(param.detach())

    return step


def deepspeed_adam(p, g) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - optional, and its import can fail in many ways
        return None
    param = torch.nn.Parameter(p)
    param.grad = g
    return DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.01).step


def measure(sizes: str, repeats: int) -> list[dict]:
    """Every row of the table as ``{"size", "what", "ms", "gbs", "vs_torch", "of_bandwidth"}``.

    Two groups per size, each run round-robin (:func:`timed`) with the bandwidth reference: the
    Adam steps (torch fused, DeepSpeedCPUAdam, ours per ISA; sharing one param and grad, each with
    its own states) and the fused passes; torch's foreach AdamW (~10x slower) is timed on its own."""
    records = []
    for size in sizes.split(","):
        n = int(float(size.rstrip("M")) * 1e6)
        p, g = torch.randn(n), torch.randn(n) * 1e-3
        adam = {"memory bandwidth (a += b)": bandwidth_step(n), "torch AdamW fused=True": torch_adamw(p, g, fused=True)}
        ds = deepspeed_adam(p, g)
        if ds is not None:
            adam["DeepSpeedCPUAdam"] = ds
        for isa in supported_isas():
            adam[f"ours {isa}"] = ours(p, g, isa)
        times = timed(adam, repeats)
        del adam, ds
        times["torch AdamW foreach=True"] = timed({"": torch_adamw(p, g, foreach=True)}, repeats)[""]
        fused = {"memory bandwidth (a += b)": bandwidth_step(n)}
        fused["fused pass: torch (3 passes)"] = torch_adamw(p, g, fused_pass=True, fused=True)
        for isa in supported_isas():
            fused[f"fused pass: ours {isa} (1 pass)"] = ours(p, g, isa, fused_pass=True)
        fused_times = timed(fused, repeats)
        del fused
        # the better of the two bandwidth readings (each taken among its group's steps)
        bw = 12 * n / min(times.pop("memory bandwidth (a += b)"), fused_times.pop("memory bandwidth (a += b)")) / 1e9
        records.append(
            {
                "size": size,
                "what": "memory bandwidth (a += b)",
                "ms": None,
                "gbs": bw,
                "vs_torch": None,
                "of_bandwidth": 1.0,
            }
        )
        base, fused_base = times["torch AdamW fused=True"], fused_times["fused pass: torch (3 passes)"]
        order = ["torch AdamW fused=True", "torch AdamW foreach=True", *times]  # the table's row order
        for what in dict.fromkeys(order):
            t = times[what]
            gbs = ADAM_BYTES * n / t / 1e9
            records.append(
                {"size": size, "what": what, "ms": t * 1e3, "gbs": gbs, "vs_torch": base / t, "of_bandwidth": gbs / bw}
            )
        for what, t in fused_times.items():
            gbs = FUSED_BYTES * n / t / 1e9
            records.append(
                {
                    "size": size,
                    "what": what,
                    "ms": t * 1e3,
                    "gbs": gbs,
                    "vs_torch": fused_base / t,
                    "of_bandwidth": gbs / bw,
                }
            )
        del p, g
    os.environ.pop(ISA_ENV, None)
    return records


def thread_counts(spec: str) -> list[int]:
    """``"1,2,all"`` -> ``[1, 2, <cores in the affinity mask>]``, duplicates dropped, order kept."""
    counts: list[int] = []
    for item in spec.split(","):
        n = len(os.sched_getaffinity(0)) if item.strip() == "all" else int(item)
        if n < 1:
            raise ValueError(f"--threads {spec}: thread counts must be >= 1 (or 'all')")
        if n not in counts:
            counts.append(n)
    return counts


def scaling(records: list[dict]) -> list[str]:
    """The thread-scaling table: one line per (size, implementation, threads)."""
    first = {(r["size"], r["what"]): r["ms"] for r in records if r["threads"] == records[0]["threads"]}
    ds = {(r["size"], r["threads"]): r["ms"] for r in records if r["what"] == "DeepSpeedCPUAdam"}
    lines = [
        f"{'size':>6} {'what':<34} {'threads':>7} {'ms':>9} {'GB/s':>7} {'of bw':>6} {'vs torch':>9} "
        f"{'vs DS':>7} {'x own 1T':>9} {'load':>5}"
    ]
    keep = [r for r in records if r["ms"] is not None and not r["what"].startswith("torch AdamW foreach")]
    for r in sorted(keep, key=lambda r: (r["size"], r["what"], r["threads"])):
        own = first[(r["size"], r["what"])] / r["ms"]
        versus_ds = ds.get((r["size"], r["threads"]))
        vs_ds = f"{versus_ds / r['ms']:6.2f}x" if versus_ds and not r["what"].startswith("fused") else ""
        lines.append(
            f"{r['size']:>6} {r['what']:<34} {r['threads']:>7} {r['ms']:9.1f} {r['gbs']:7.1f} {r['of_bandwidth']:6.2f} "
            f"{r['vs_torch']:8.2f}x {vs_ds:>7} {own:8.2f}x {r['load']:5.2f}"
        )
    return lines


def plot(records: list[dict], path: str) -> None:
    """The thread-scaling table as a PNG (ms per step against threads, one line per implementation
    and size); says so and returns when matplotlib is not installed (it is not a dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed, no plot written (pip install matplotlib)")
        return
    fig, (ax, ax_bw) = plt.subplots(1, 2, figsize=(14, 5))
    keep = [r for r in records if not r["what"].startswith("torch AdamW foreach")]
    for key in sorted({(r["size"], r["what"]) for r in keep}):
        rows = sorted((r for r in keep if (r["size"], r["what"]) == key), key=lambda r: r["threads"])
        threads, label = [r["threads"] for r in rows], f"{key[0]} {key[1]}"
        if rows[0]["ms"] is not None:
            ax.plot(threads, [r["ms"] for r in rows], marker="o", label=label)
        style = "k--" if rows[0]["ms"] is None else "-"
        ax_bw.plot(threads, [r["gbs"] for r in rows], style, marker="o", label=label)
    ax.set(xlabel="threads", ylabel="ms per step (lower is better)", title="CPU Adam step: thread scaling")
    ax_bw.set(xlabel="threads", ylabel="GB/s (dashed: a += b bandwidth)", title="achieved bandwidth")
    for axis in (ax, ax_bw):
        axis.set_xticks(sorted({r["threads"] for r in keep}))
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50M,100M", help="comma-separated, M = 1e6 parameters")
    parser.add_argument("--threads", default="1,2,all", help="comma-separated thread counts; 'all' = affinity mask")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default=None, help="write the thread-scaling plot to this PNG (needs matplotlib)")
    args = parser.parse_args()
    counts = thread_counts(args.threads)
    records = []
    for threads in counts:
        torch.set_num_threads(threads)
        load = os.getloadavg()[0]
        print(
            f"threads={torch.get_num_threads()} isas={supported_isas()} torch={torch.__version__} "
            f"load average (1 min) before={load:.2f}"
        )
        print(f"{'size':>6} {'what':<34} {'ms':>9} {'GB/s':>7} {'vs torch fused':>15} {'of bandwidth':>13}")
        for r in measure(args.sizes, args.repeats):
            records.append(dict(r, threads=threads, load=load))
            if r["ms"] is None:
                print(f"{r['size']:>6} {r['what']:<34} {'':>9} {r['gbs']:7.1f}")
            else:
                print(
                    f"{r['size']:>6} {r['what']:<34} {r['ms']:9.1f} {r['gbs']:7.1f} {r['vs_torch']:14.2f}x "
                    f"{r['of_bandwidth']:12.2f}"
                )
    print(f"\nthread scaling ({', '.join(map(str, counts))} threads; 'x own 1T' against {counts[0]} thread(s))")
    print("\n".join(scaling(records)))
    if args.plot:
        plot(records, args.plot)


if __name__ == "__main__":
    main()
