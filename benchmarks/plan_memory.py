"""The plan's peak memory of a training step against the OS-measured peak RSS growth of real ranks.

Run: ``python benchmarks/plan_memory.py [--ranks 2] [--json benchmarks/results/plan-peak-memory.json]``
     ``--quick``: tiny models (checks the script, not the numbers)

Each case runs in freshly spawned gloo ranks (so no earlier case's freed memory is in the process):
a rank reads its resident set (``VmRSS``) after the process group starts, builds the model and the
engine (bf16-mixed, AdamW), runs two training steps (the pools and the optimizer states are then
allocated), resets the kernel's high-water mark (``/proc/self/clear_refs``), runs a third step and
reads ``VmHWM``, with glibc's mmap threshold fixed (below) so that freed tensors leave the resident
set. The growth is ``VmHWM - VmRSS at the start``: the model states, the engine's pool
and the step's transient peak, plus whatever the allocator keeps of memory freed during construction.
The plan of the same case (``device="cpu"``) predicts it as :attr:`Plan.peak`, the model states and
pool (``memory_breakdown()``'s categories) plus the step's transient peak counted on meta tensors.
Shapes: those of ``benchmarks/plan_check.py``; the GPTs also with every block checkpointed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# glibc raises its mmap threshold each time a large block is freed, and keeps later blocks below it
# on the heap after they are freed: the resident set then holds memory the program no longer uses
# (measured: the same peak with and without activation checkpointing). A fixed 128 KiB threshold
# (glibc's initial one) returns every tensor's memory when it is freed, so the high-water mark is
# the live peak. Read by glibc at process start: set before the ranks (and their fork server) start.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))

import common
import plan_check
import torch
import torch.distributed as dist

from recipes.gpt2.model import Block, GPTConfig

LAYOUTS = [("zero1", 1, False), ("zero2", 2, False), ("zero3", 3, False), ("zero3_offload", 3, True)]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure(rank: int, shape: str, stage: int, offload: bool, checkpoint: bool) -> int:
    """Peak RSS growth (bytes) of this rank over a training step, from before the model existed."""
    from lightning_zero import comm
    from lightning_zero.activations import apply_activation_checkpointing
    from lightning_zero.config import ActivationCheckpointConfig, OffloadConfig, StrategyConfig, ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo")
    try:
        group = dist.group.WORLD
        generator = torch.Generator().manual_seed(rank)
        x = plan_check._inputs(shape, generator)
        comm.barrier(group)
        start = _status("VmRSS")
        torch.manual_seed(0)
        model = plan_check._model(shape)
        optimizer = torch.optim.AdamW(model.parameters())
        activations = ActivationCheckpointConfig(policy=Block if checkpoint else None)
        apply_activation_checkpointing(model, activations, None, stage == 3)
        config = StrategyConfig(
            zero=ZeroConfig(stage=stage), offload=OffloadConfig(offload_optimizer=offload), activations=activations
        )
        engine = ZeroEngine(model, [optimizer], config=config, precision="bf16-mixed", device=torch.device("cpu"))
        for step in range(3):
            if step == 2:
                comm.barrier(group)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # the high-water mark restarts at the current resident set
            plan_check._loss(shape, model, x).backward()
            engine.backward_done()
            engine.step(optimizer)
        growth = _status("VmHWM") - start
        engine.close()
        return growth
    finally:
        dist.destroy_process_group()


def planned(shape: str, stage: int, offload: bool, checkpoint: bool, world_size: int) -> object:
    """The plan of one case (device ``cpu``)."""
    from lightning_zero.config import ActivationCheckpointConfig, OffloadConfig, ZeroConfig
    from lightning_zero.plan import plan

    kind, config, dims = plan_check.SHAPES[shape]
    return plan(
        "recipes.gpt2.model:GPT" if kind == "gpt" else "common:SquareStack",
        world_size,
        zero=ZeroConfig(stage=stage),
        offload=OffloadConfig(offload_optimizer=offload),
        device="cpu",
        model_kwargs={"config": config} if config is not None else None,
        inputs=[(dims, torch.int64 if kind == "gpt" else torch.float32)],
        activations=ActivationCheckpointConfig(policy=Block if checkpoint else None),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--shapes", default=",".join(plan_check.SHAPES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        common.use_tiny_models()
        plan_check.SHAPES["gpt"] = ("gpt", common.MODEL, (2, 16))
        plan_check.SHAPES["gpt-deep"] = (
            "gpt",
            GPTConfig(vocab_size=128, block_size=32, n_layer=3, n_head=2, n_embd=16),
            (2, 32),
        )
        plan_check.SHAPES["square"] = ("square", None, (4, common.SQUARE_WIDTH))
    rows = []
    for world_size in (int(n) for n in args.ranks.split(",")):
        for shape in args.shapes.split(","):
            checkpoints = (False, True) if plan_check.SHAPES[shape][0] == "gpt" else (False,)
            for label, stage, offload in LAYOUTS:
                for checkpoint in checkpoints:
                    growth = common.run_ranks(measure, shape, stage, offload, checkpoint, world_size=world_size)[0]
                    p = planned(shape, stage, offload, checkpoint, world_size)
                    mib = 2**20
                    row = [
                        shape,
                        label + (" + checkpointing" if checkpoint else ""),
                        world_size,
                        f"{p.total('device') / mib:.1f}",  # type: ignore[attr-defined]
                        f"{p.transient_peak / mib:.1f}",  # type: ignore[attr-defined]
                        f"{p.peak / mib:.1f}",  # type: ignore[attr-defined]
                        f"{growth / mib:.1f}",
                        f"{p.peak / growth:.2f}",  # type: ignore[attr-defined]
                    ]
                    rows.append(row)
                    print(" | ".join(str(c) for c in row), flush=True)
    headers = [
        "shape",
        "layout",
        "ranks",
        "planned states + pool MiB",
        "planned step transient MiB",
        "planned peak MiB",
        "measured peak RSS growth MiB",
        "planned / measured",
    ]
    print(common.format_table(headers, rows))
    ratios = [float(r[-1]) for r in rows]
    summary = f"{sum(0.85 <= r <= 1.15 for r in ratios)} of {len(ratios)} cases within 15% (ratios {min(ratios):.2f} to {max(ratios):.2f})"
    print(summary)
    common.write_json(
        args.json,
        {
            "machine": {**common.machine(), "ranks": f"{args.ranks} gloo ranks, 1 thread each"},
            "title": f"plan_memory.py: planned peak against the OS-measured peak RSS growth ({args.ranks} ranks)",
            "topic": "memory",
            "command": ("python benchmarks/plan_memory.py " + " ".join(sys.argv[1:])).strip(),
            "headers": headers,
            "rows": rows,
            "notes": [summary],
        },
    )


if __name__ == "__main__":
    main()
