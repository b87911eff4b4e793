"""What DeepSpeed's pipelined offload changes for zero2_offload on the CPU.

Run: ``python benchmarks/offload_pipeline.py [--steps 6] [--warmup 2] [--rounds 3] [--precisions 32-true,bf16-mixed]``

The benchmark GPT (benchmarks/common.py: ~14M parameters, seq 128, micro-batch 4 per rank, AdamW)
trains with ``zero2_offload`` on 2 CPU/gloo ranks (one thread each, lightning_zero.threads' choice),
with ``offload_pipeline=False`` (every bucket of 5M elements stepped by the host kernel, then all
buckets all-gathered) and ``offload_pipeline=True`` (each bucket's all-gather starts as soon as the
kernel has stepped it and written its 16-bit copy, while the next bucket steps). Configurations run
interleaved, ``--rounds`` times, in the same two processes, so a busy moment of the shared machine
hits both alike; the first ``--warmup`` steps of every run are dropped.

Two times per step, rank 0, medians over every kept step:

* **step**: between two consecutive ``on_train_batch_end`` (forward, backward, reduction, step, publish);
* **optimizer + publish**: inside ``ZeroEngine.step`` (gradient slices to the masters, clipping,
  the host kernels, the copy-back and the all-gathers): the part pipelining can change.

On a CPU-only machine the 16-bit "copy-back" is written by the kernel in its own pass, so what the
pipeline overlaps here is the gloo all-gather of bucket ``i`` (gloo's threads) with the kernel on
bucket ``i + 1``; on a GPU it also overlaps each bucket's host-to-device copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import lightning.pytorch as pl

CONFIGS = (("unpipelined", False), ("pipelined", True))


class StepClock(pl.Callback):
    """Wall-clock stamps at every training batch end."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())


def _run(rank: int, precision: str, pipeline: bool, total: int, warmup: int) -> tuple[list[float], list[float]]:
    from lightning_zero.zero import engine

    phase: list[float] = []
    original = engine.ZeroEngine.step

    def timed_step(self, *args, **kwargs):  # the engine's whole step, as the strategy calls it
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            phase.append(time.perf_counter() - start)

    engine.ZeroEngine.step = timed_step  # type: ignore[method-assign]  # a timer, in a benchmark rank only
    try:
        pl.seed_everything(0, verbose=False)
        clock = StepClock()
        strategy = common.build_strategy("zero2_offload", offload_pipeline=pipeline)
        trainer = common.make_trainer(strategy, precision, total, [clock])
        trainer.fit(common.GPTModule(), train_dataloaders=common.make_loader(total, rank))
    finally:
        engine.ZeroEngine.step = original  # type: ignore[method-assign]
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)][max(warmup - 1, 0) :]
    return steps, phase[warmup:]


def _worker(rank: int, precisions: list[str], steps: int, warmup: int, rounds: int) -> dict:
    import lightning_zero  # noqa: F401 - registers the strategy names

    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for precision in precisions:
            for name, pipeline in CONFIGS:
                step, phase = _run(rank, precision, pipeline, warmup + steps, warmup)
                entry = times.setdefault(f"{precision} {name}", {"step": [], "phase": []})
                entry["step"] += step
                entry["phase"] += phase
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run excluded from timing")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every configuration")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="comma-separated Lightning precisions")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    load_before = common.machine()["load average"]
    times = common.run_ranks(_worker, precisions, args.steps, args.warmup, args.rounds)[0]

    rows = []
    for precision in precisions:
        base = times[f"{precision} unpipelined"]
        for name, _ in CONFIGS:
            t = times[f"{precision} {name}"]
            step, phase = statistics.median(t["step"]), statistics.median(t["phase"])
            rows.append(
                [
                    f"zero2_offload {precision} {name}",
                    f"{step * 1e3:.0f}",
                    f"{statistics.median(base['step']) / step:.3f}",
                    f"{phase * 1e3:.1f}",
                    f"{min(t['phase']) * 1e3:.1f}-{max(t['phase']) * 1e3:.1f}",
                    f"{statistics.median(base['phase']) / phase:.3f}",
                    f"{min(base['phase']) / min(t['phase']):.3f}",
                    len(t["step"]),
                ]
            )
    print(
        f"\nzero2_offload on {common.WORLD_SIZE} CPU/gloo ranks, GPT {common.num_params(common.GPTModule()):,} "
        f"parameters, buckets of 5M elements; medians over {args.rounds} interleaved rounds of {args.steps} "
        f"steps ({args.warmup} warm-up dropped per run). Speed-ups are unpipelined / this row (> 1: faster)."
    )
    headers = ["config", "step ms", "step speed-up", "opt+publish ms", "min-max ms", "speed-up", "of minima", "steps"]
    print(common.format_table(headers, rows))
    print(f"\nload before: {load_before}; " + "; ".join(f"{k}: {v}" for k, v in common.machine().items()))


if __name__ == "__main__":
    main()
