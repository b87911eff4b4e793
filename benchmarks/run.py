"""One command: the same small GPT (and BERT) under DDP, FSDP2, ZeroRedundancyOptimizer, lightning_zero
and DeepSpeed on 2 CPU/gloo ranks; one table of step time and bytes per rank; JSON and PNG plots.

    python benchmarks/run.py [--quick] [--out DIR] [--against REF]

``--against REF``: the same measurements of the working tree and of a git ref (a temporary
worktree), interleaved in one run, in one table of step time and memory per rank side by side
(``against.py``).

Full run: GPT and BERT, "bf16-mixed" and "32-true" (only "32-true" on a CPU without native bf16,
where bf16 steps take ~40x longer; ``--precisions`` forces both), 6 timed steps after 2 warm-up
steps per run, 3 interleaved rounds, CPU Adam at 100M parameters. ``--quick``: GPT only, in the one precision
this CPU is fast at ("bf16-mixed" with native bf16, AVX512_BF16 or AMX; else "32-true", as the
recipes' ``precision: auto``; the table says which), 5 timed steps, 3 rounds, CPU Adam at 50M;
every system is still run.

Peak RSS per rank (what the OS sees: ``measure.PeakRss``) is measured in a second pass that runs
every configuration once more in fresh ranks of its own (``--no-rss`` skips it).

Configurations run interleaved in the same two processes (a busy moment of the machine hits all of
them alike); the table reports the median of all kept steps of rank 0. DeepSpeed runs when
``deepspeed`` imports with ``DS_ACCELERATOR=cpu`` (its C++ ops are built on first use, into
``.cache/torch_extensions``). A configuration that fails is reported in the table with its error
and the others go on. See benchmarks/README.md for what each system is and how bytes are counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
# DeepSpeed picks its accelerator at import; the ranks inherit these. Its JIT-built ops go to a
# gitignored cache inside the checkout, so a second run does not rebuild them.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))

import against
import common
import report
import systems

OURS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
TORCH = ("ddp", "fsdp2", "fsdp2_no_reshard", "zero_redundancy")


def deepspeed_available() -> bool:
    """True when ``deepspeed`` imports (it is optional; nothing here requires it)."""
    try:
        import deepspeed  # noqa: F401 (only whether it imports)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def _worker(rank: int, configs: list, warmup: int, steps: int, rounds: int, smoke: bool) -> dict:
    from measure import Clock

    import lightning_zero  # noqa: F401 - registers the strategy names

    if smoke:
        common.use_tiny_models()
    out: dict = {"psi": {w: common.num_params(common.WORKLOADS[w]()) for w, _, _ in configs}}
    for _ in range(rounds):
        for workload, precision, system in configs:
            key = f"{workload} {precision} {system}"
            began = time.perf_counter()
            try:
                result = systems.run(rank, system, precision, workload, warmup + steps)
                clock = Clock()
                clock.stamps = result.pop("stamps")
                result["steps"] = clock.steps(warmup)
            except Exception:  # noqa: BLE001 - one failing system must not hide the others' numbers
                result = {"error": traceback.format_exc()}
                if rank == 0:
                    print(f"[run.py] {key} failed:\n{result['error']}", file=sys.stderr, flush=True)
            if rank == 0 and "steps" in result:
                median = sorted(result["steps"])[len(result["steps"]) // 2] if result["steps"] else float("nan")
                print(
                    f"[run.py] {key}: {time.perf_counter() - began:.0f} s, median step {median * 1e3:.0f} ms, "
                    f"{result['bytes'] / 2**20:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
            out.setdefault(key, []).append(result)
    return out


def rss_pass(configs: list, warmup: int, steps: int, smoke: bool) -> dict[str, dict[str, Any]]:
    """Per configuration, each in fresh ranks: the peak RSS growth per rank (the larger rank's; a
    string where the run failed) and, for ours, what memory_breakdown() plus the activations
    account for on that rank at the end of a forward (``accounted``), with the resident set then (``resident``)."""
    peaks: dict[str, dict[str, Any]] = {}
    for config in configs:
        key = " ".join(config)
        try:
            per_rank = common.run_ranks(_worker, [config], warmup, steps, 1, smoke)
            runs = [rank[key][0] for rank in per_rank]
            failed = [r["error"] for r in runs if "error" in r]
            if failed:
                peaks[key] = {"peak": failed[0]}
            else:
                top = max(runs, key=lambda r: r["peak_rss"])
                accounted = resident = None
                if top.get("split") and top.get("monitor"):
                    # MemoryMonitor: memory_breakdown() + activations + what the OS adds (glibc's freed
                    # heap memory, library pages), against the resident set at the same moment (the
                    # end of a forward)
                    accounted, resident = top["monitor"]["accounted"], top["monitor"]["resident"]
                peaks[key] = {"peak": top["peak_rss"], "accounted": accounted, "resident": resident}
                if top.get("monitor"):
                    mib = {k: round(v / 2**20, 1) for k, v in top["monitor"].items()}
                    print(f"[run.py] MemoryMonitor {key} (MiB): {mib}", file=sys.stderr, flush=True)
        except AssertionError as error:  # a rank died (e.g. killed for memory): say so, go on
            peaks[key] = {"peak": str(error)}
        if isinstance(peaks[key]["peak"], int):
            print(
                f"[run.py] peak RSS {key}: {peaks[key]['peak'] / 2**20:.0f} MiB per rank", file=sys.stderr, flush=True
            )
    return peaks


def _profile_worker(rank: int, system: str, precision: str, workload: str, warmup: int, steps: int) -> dict:
    """rank 0's torch.profiler tables over the steps after the warm-up (setup and teardown excluded)."""
    import torch
    from measure import Clock

    import lightning_zero  # noqa: F401 (registers the strategy names)

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def listener(ticks: int) -> None:
        if ticks == warmup:
            prof.__enter__()
        elif ticks == warmup + steps:
            prof.__exit__(None, None, None)

    Clock.listeners.append(listener)
    result = systems.run(rank, system, precision, workload, warmup + steps)
    averages = prof.key_averages()
    # self time finds the hot ops; total time shows the labelled regions (lightning_zero::*) with what they wait on
    return {
        "self": averages.table(sort_by="self_cpu_time_total", row_limit=25),
        "total": averages.table(sort_by="cpu_time_total", row_limit=25),
        "stamps": result["stamps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="GPT, this CPU's fastest precision, fewer steps: < 15 min on 2 cores"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="directory for results.json and *.png")
    parser.add_argument(
        "--systems",
        help="comma-separated subset (default: all); ours take options: zero2@host_mmap_threshold=131072",
    )
    parser.add_argument("--workloads", help="gpt,bert (default: both; --quick: gpt)")
    parser.add_argument(
        "--precisions",
        help="bf16-mixed,32-true (default: both where the CPU has native bf16, else 32-true; --quick: the faster one)",
    )
    parser.add_argument("--steps", type=int, help="timed steps per run (default 6; --quick 5)")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run excluded from timing")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every configuration")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when installed")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS pass (fresh ranks per configuration)")
    parser.add_argument("--no-cpu-adam", action="store_true", help="skip the CPU Adam throughput measurement")
    parser.add_argument("--smoke", action="store_true", help="tiny models, 1 step: checks that every system runs")
    parser.add_argument("--profile", metavar="SYSTEM", help="instead: torch.profiler of one system on rank 0")
    parser.add_argument(
        "--against",
        metavar="REF",
        help="instead: the working tree against git REF (branch, tag, HEAD~1, commit), interleaved in one run; "
        "--rounds repetitions per system; writes OUT/against.json",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0 or (args.steps is not None and args.steps < 1):
        parser.error(f"--rounds {args.rounds}, --warmup {args.warmup}, --steps {args.steps}: need >= 1, >= 0, >= 1")
    if args.against is not None:
        if args.profile:
            parser.error("--against and --profile do different things: pass one of them")
        try:
            against.resolve(args.against)  # a wrong ref fails here, before anything runs
        except ValueError as error:
            parser.error(str(error))

    workloads = (args.workloads or ("gpt" if args.quick else "gpt,bert")).split(",")
    # --quick runs one precision: the one this CPU is fast at (bf16 is ~40x slower than fp32 without
    # AVX512_BF16/AMX), chosen as the recipes' "precision: auto" does (lightning_zero.hardware).
    from lightning_zero.hardware import auto_precision

    quick_precision = auto_precision("cpu")
    # The full run measures both precisions where bf16 is native; on a CPU without it bf16-mixed
    # steps take ~40x longer and the run hours: there it runs 32-true and says so (--precisions forces).
    full_precisions = "bf16-mixed,32-true" if quick_precision == "bf16-mixed" else "32-true"
    precisions = (args.precisions or (quick_precision if args.quick else full_precisions)).split(",")
    steps = args.steps or (5 if args.quick else 6)
    with_deepspeed = not args.no_deepspeed and deepspeed_available()
    names = list(TORCH + OURS) + (list(systems.DEEPSPEED) if with_deepspeed else [])
    if args.systems:
        names = [s for s in args.systems.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.against is not None:
        plan = against.Plan(
            systems=names,
            workloads=workloads,
            precisions=precisions,
            steps=steps,
            warmup=args.warmup,
            repetitions=args.rounds,
            rss=not args.no_rss,
            smoke=args.smoke,
            quick=args.quick,
        )
        against.run(args.against, plan, out, "python benchmarks/run.py " + " ".join(sys.argv[1:]))
        return

    if args.profile:
        prof = common.run_ranks(_profile_worker, args.profile, precisions[0], workloads[0], args.warmup, steps)[0]
        durations = [
            b - a for a, b in zip(prof["stamps"][args.warmup - 1 :], prof["stamps"][args.warmup :], strict=False)
        ]
        print(
            f"{args.profile} {precisions[0]} {workloads[0]}: {steps} profiled steps, "
            f"{', '.join(f'{d * 1e3:.0f}' for d in durations)} ms\n"
        )
        print(prof["self"], "\n", prof["total"])
        return

    start = time.perf_counter()
    configs = [(w, p, s) for w in workloads for p in precisions for s in names]
    per_rank = common.run_ranks(_worker, configs, args.warmup, steps, args.rounds, args.smoke)
    peaks = {} if args.no_rss else rss_pass(configs, args.warmup, 2, args.smoke)
    records = report.summarize(configs, per_rank, args.warmup, common.WORLD_SIZE, peaks)
    train_s = time.perf_counter() - start

    cpu_adam = None
    if not args.no_cpu_adam:
        import cpu_adam as cpu_adam_bench
        import torch

        torch.set_num_threads(common.WORLD_SIZE)
        cpu_adam = cpu_adam_bench.measure("50M" if args.quick else "100M", repeats=3 if args.quick else 5)

    psi = ", ".join(f"{w} {per_rank[0]['psi'][w]:,}" for w in workloads)
    print(
        f"\nΨ = {psi} parameters; "
        f"{common.WORLD_SIZE} CPU/gloo ranks, 1 thread each; seq {common.SEQ}, micro-batch {common.MICRO_BATCH} "
        f"per rank, AdamW; median of {steps} steps x {args.rounds} rounds after {args.warmup} warm-up steps per run."
    )
    if args.quick and not args.precisions:
        print(f"Precision: {quick_precision}, this CPU's fastest (lightning_zero.hardware.auto_precision).")
    elif not args.precisions and quick_precision != "bf16-mixed":
        print("Precision: 32-true only: this CPU has no native bf16 (bf16-mixed ~40x slower); --precisions forces it.")
    if not with_deepspeed:
        print("DeepSpeed: not run (not importable with DS_ACCELERATOR=cpu, or --no-deepspeed).")
    print("\n" + report.table(records))
    if cpu_adam:
        bw = next(r["gbs"] for r in cpu_adam if r["ms"] is None)
        best = max(
            (r for r in cpu_adam if r["what"].startswith("ours") and "fused" not in r["what"]), key=lambda r: r["gbs"]
        )
        print(
            f"\nCPU Adam ({cpu_adam[0]['size']} parameters, {common.WORLD_SIZE} threads): {best['what']} "
            f"{best['gbs']:.1f} GB/s = {best['of_bandwidth']:.2f} of the measured bandwidth {bw:.1f} GB/s, "
            f"{best['vs_torch']:.2f}x torch fused AdamW"
        )
    total_s = time.perf_counter() - start
    print("\n" + "; ".join(f"{k}: {v}" for k, v in common.machine().items()) + f"; wall time {total_s / 60:.1f} min")
    payload = {
        "quick": args.quick,
        "steps": steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "world_size": common.WORLD_SIZE,
        "train_wall_s": train_s,
        "wall_s": total_s,
        "results": records,
        "cpu_adam": cpu_adam,
        "table": report.table(records),
    }
    paths = [report.write(out, payload), *report.plots(out, records, cpu_adam)]
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
