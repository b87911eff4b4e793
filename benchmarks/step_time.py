"""Median training-step time of ZeRO stage 1/2 against Lightning's DDP (and DeepSpeed, if installed).

Run: ``python benchmarks/step_time.py [--steps 6] [--warmup 2] [--rounds 2] [--json step_time.json]``
     ``python benchmarks/step_time.py --profile ddp:32-true,zero2:32-true`` (torch.profiler, per op)

The benchmark GPT (benchmarks/common.py: ~14M parameters, seq 128, micro-batch 4 per rank, AdamW)
trains on 2 CPU/gloo ranks, one thread each, on the same per-rank data in every configuration.
A step's time is the interval between two consecutive ``on_train_batch_end`` (forward, backward,
gradient reduction, optimizer step and, for ZeRO, the all-gather of the updated parameters); the
first ``--warmup`` steps of every run are dropped. Configurations run interleaved, ``--rounds``
times, in the same two processes, so that a busy moment of the machine hits all of them alike; the
table reports the median over all kept steps and the ratio to DDP of the same precision.

DeepSpeed (optional): when ``deepspeed`` imports with ``DS_ACCELERATOR=cpu``, the same model and
data also run through ``deepspeed.initialize`` with ZeRO stage 1 and 2 (its defaults otherwise;
"bf16-mixed" = DeepSpeed's ``bf16`` section: bf16 parameters and gradients, fp32 master + states).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# DeepSpeed picks its accelerator at import; the ranks inherit this.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import common
import lightning.pytorch as pl
import torch

STRATEGIES = ("ddp", "zero1", "zero2")
PRECISIONS = ("bf16-mixed", "32-true")
TARGET = 1.05


def deepspeed_available() -> bool:
    """True when ``deepspeed`` imports (it is optional; nothing here requires it)."""
    try:
        import deepspeed  # noqa: F401 (only whether it imports)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


class StepClock(pl.Callback):
    """Wall-clock stamps at every training batch end."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())


def _steps(stamps: list[float], warmup: int) -> list[float]:
    """Step durations after ``warmup`` steps (the first stamp only opens the first interval)."""
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)][max(warmup - 1, 0) :]


def _lightning_run(rank: int, strategy: str, precision: str, total: int, profiler=None) -> list[float]:
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    callbacks = [clock] if profiler is None else [clock, profiler]
    trainer = common.make_trainer(common.build_strategy(strategy), precision, total, callbacks)
    trainer.fit(common.GPTModule(), train_dataloaders=common.make_loader(total, rank))
    return clock.stamps


def _deepspeed_run(rank: int, stage: int, precision: str, total: int) -> list[float]:
    import deepspeed

    pl.seed_everything(0, verbose=False)
    module = common.GPTModule()
    config = {
        "train_micro_batch_size_per_gpu": common.MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16-mixed"},
        # torch.optim.AdamW is elementwise; DeepSpeed asks for this flag for any client optimizer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    # The process group is Lightning's (gloo); DeepSpeed reuses an initialized one.
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=module.model, optimizer=module.configure_optimizers(), config=config)
    stamps = []
    for input_ids, labels in common.make_loader(total, rank):
        loss = common.GPT.loss_fn(engine(input_ids), labels)
        engine.backward(loss)
        engine.step()
        stamps.append(time.perf_counter())
    return stamps


def _configs(with_deepspeed: bool) -> list[tuple[str, str]]:
    names = list(STRATEGIES) + (["deepspeed1", "deepspeed2"] if with_deepspeed else [])
    return [(name, precision) for precision in PRECISIONS for name in names]


def _worker(rank: int, steps: int, warmup: int, rounds: int, with_deepspeed: bool) -> dict:
    import lightning_zero  # noqa: F401 - registers the strategy names

    total = warmup + steps
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, precision in _configs(with_deepspeed):
            if name.startswith("deepspeed"):
                stamps = _deepspeed_run(rank, int(name[-1]), precision, total)
            else:
                stamps = _lightning_run(rank, name, precision, total)
            times.setdefault(f"{name} {precision}", []).extend(_steps(stamps, warmup))
    return times


def _profile_worker(rank: int, configs: list[str], steps: int, warmup: int) -> dict:
    """Self CPU ms per step of every op (rank 0), for each ``strategy:precision`` in ``configs``."""
    import lightning_zero  # noqa: F401 (registers the strategy names)

    class Profile(pl.Callback):
        """Profiles the steps after the warm-up (from the end of step ``warmup`` to the end of training)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == warmup - 1:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_train_end(self, trainer, pl_module) -> None:
            self.prof.__exit__(None, None, None)

    out = {}
    for config in configs:
        profile = Profile()
        strategy, precision = config.split(":")
        stamps = _lightning_run(rank, strategy, precision, warmup + steps, profiler=profile)
        ops = {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in profile.prof.key_averages()}
        # The labelled collectives run asynchronously: their own time is the launch, not the wait.
        ops["[wall step]"] = (statistics.median(_steps(stamps, warmup)) * 1e3, 1)
        out[config] = ops
    return out


def _print_profile(profiles: dict, rows: int = 30) -> None:
    configs = list(profiles)
    names = {name for ops in profiles.values() for name in ops}
    top = sorted(names, key=lambda n: -max(p.get(n, (0, 0))[0] for p in profiles.values()))[:rows]
    table = [
        [n[:58], *(f"{profiles[c].get(n, (0, 0))[0]:.1f} ({profiles[c].get(n, (0, 0))[1]})" for c in configs)]
        for n in top
    ]
    print("\nSelf CPU ms per step (calls per step), rank 0, sorted by the largest:\n")
    print(common.format_table(["op", *configs], table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="steps per run excluded from timing")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every configuration")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed even when installed")
    parser.add_argument(
        "--profile", metavar="S:P[,S:P]", help="profile configurations (e.g. ddp:32-true,zero2:32-true) instead"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the numbers to this JSON file")
    args = parser.parse_args()

    if args.profile:
        _print_profile(common.run_ranks(_profile_worker, args.profile.split(","), args.steps, args.warmup)[0])
        return
    with_deepspeed = not args.no_deepspeed and deepspeed_available()
    # Collectives keep the ranks in lockstep; rank 0's clock is the step time.
    times = common.run_ranks(_worker, args.steps, args.warmup, args.rounds, with_deepspeed)[0]

    rows, records = [], []
    for name, precision in _configs(with_deepspeed):
        kept = times[f"{name} {precision}"]
        median = statistics.median(kept)
        ddp = statistics.median(times[f"ddp {precision}"])
        ratio = median / ddp
        # On a shared machine the fastest step is the one least disturbed by other processes.
        min_ratio = min(kept) / min(times[f"ddp {precision}"])
        spread = f"{min(kept) * 1e3:.0f}-{max(kept) * 1e3:.0f}"
        verdict = "" if name == "ddp" or name.startswith("deepspeed") else ("ok" if ratio <= TARGET else "OVER")
        rows.append(
            [
                f"{name} {precision}",
                f"{median * 1e3:.0f}",
                spread,
                len(kept),
                f"{ratio:.3f}",
                f"{min_ratio:.3f}",
                verdict,
            ]
        )
        records.append(
            {
                "config": name,
                "precision": precision,
                "median_s": median,
                "ratio_to_ddp": ratio,
                "min_ratio_to_ddp": min_ratio,
                "steps_s": kept,
            }
        )

    print(
        f"\nMedian step time, {common.WORLD_SIZE} CPU/gloo ranks, GPT {common.num_params(common.GPTModule()):,} "
        f"parameters, seq {common.SEQ}, micro-batch {common.MICRO_BATCH} per rank, AdamW; "
        f"{args.warmup} warm-up steps dropped per run, {args.rounds} interleaved rounds."
    )
    if not with_deepspeed:
        print("DeepSpeed: not run (not importable with DS_ACCELERATOR=cpu, or --no-deepspeed).")
    print()
    print(
        common.format_table(
            ["config", "median ms", "min-max ms", "steps", "ratio to DDP", "ratio of minima", f"<= {TARGET}"], rows
        )
    )
    print("\n" + "; ".join(f"{k}: {v}" for k, v in common.machine().items()))
    common.write_json(
        args.json, {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "results": records}
    )


if __name__ == "__main__":
    main()
