"""The plan's predicted step time against measured steps of the real engine on this machine.

Run: ``python benchmarks/plan_check.py [--ranks 1,2,4] [--steps 4] [--json benchmarks/results/plan-step-time.json]``
     ``--quick``: tiny models, one step each (checks the script, not the numbers)

For each world size: :func:`lightning_zero.plan.machine.calibrate` measures this machine as that many
gloo ranks (micro-benchmarks of each op class and collective, a few seconds; never the models
below); then the same ranks train four shapes (the benchmark GPT of ``benchmarks/common.py``, a
deeper and narrower GPT at a longer sequence, the square stack of eight 2048-wide Linear layers,
and an MLP of odd widths held out while the model was developed) at stages 1, 2, 3 and with the
optimizer offloaded at stages 2 and 3 (bf16-mixed, AdamW, the strategy's defaults otherwise, glibc's
mmap threshold set as the strategy sets it for CPU training), through the engine itself
(:class:`~lightning_zero.zero.engine.ZeroEngine`), and time each step between barriers; the first
two steps are dropped and the median of the rest is reported. The plan of each case (meta tensors,
fake process group) is timed on the calibrated machine and printed beside the measurement, with the
ratio planned / measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch
import torch.distributed as dist

from recipes.gpt2.model import GPT, GPTConfig


class OddMLP(torch.nn.Module):
    """Residual blocks of LayerNorm, Linear(width, hidden), SiLU, Linear(hidden, width) at odd widths:
    the shape the step-time model was validated on without being developed on it."""

    def __init__(self, width: int = 1000, hidden: int = 2900, depth: int = 5) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, hidden),
                torch.nn.SiLU(),
                torch.nn.Linear(hidden, width),
            )
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


#: name -> (model kind, config, inputs' shape); "gpt" is the benchmark GPT, micro-batch 4 x 128;
#: "mlp-odd" is the shape held out while the model was developed
SHAPES: dict[str, tuple[str, Any, tuple[int, int]]] = {
    "gpt": ("gpt", common.MODEL, (4, 128)),
    "gpt-deep": ("gpt", GPTConfig(vocab_size=4096, block_size=256, n_layer=12, n_head=4, n_embd=256), (2, 256)),
    "square": ("square", None, (64, 2048)),
    "mlp-odd": ("odd", {"width": 1000, "hidden": 2900, "depth": 5}, (100, 1000)),
}
#: (label, stage, offload_optimizer)
LAYOUTS = [
    ("zero1", 1, False),
    ("zero2", 2, False),
    ("zero3", 3, False),
    ("zero2_offload", 2, True),
    ("zero3_offload", 3, True),
]


def _model(shape: str) -> torch.nn.Module:
    kind, config, _ = SHAPES[shape]
    return GPT(config) if kind == "gpt" else OddMLP(**config) if kind == "odd" else common.SquareStack()


def _inputs(shape: str, generator: torch.Generator) -> torch.Tensor:
    kind, config, dims = SHAPES[shape]
    if kind == "gpt":
        return torch.randint(0, config.vocab_size, dims, generator=generator)
    return torch.randn(*dims, generator=generator).to(torch.bfloat16)


def _loss(shape: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if SHAPES[shape][0] == "gpt":  # what the plan computes for token ids and (batch, seq, vocab) logits
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), x.flatten())
    return out.float().mean()


def measure(rank: int, cases: list[tuple[str, str, int, bool]], steps: int) -> list[float]:
    """Median step seconds (rank 0's clock, between barriers) of each case on these ranks."""
    from lightning_zero import comm, memory
    from lightning_zero.config import OffloadConfig, StrategyConfig, ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    out = []
    # as the strategy sets up CPU training (lightning_zero/lifecycle.py): glibc's mmap threshold
    threshold = ZeroConfig().host_mmap_threshold
    fixed = threshold is not None and memory.fix_mmap_threshold(threshold)
    try:
        for shape, _, stage, offload in cases:
            torch.manual_seed(0)
            model = _model(shape)
            optimizer = torch.optim.AdamW(model.parameters())
            config = StrategyConfig(zero=ZeroConfig(stage=stage), offload=OffloadConfig(offload_optimizer=offload))
            engine = ZeroEngine(model, [optimizer], config=config, precision="bf16-mixed", device=torch.device("cpu"))
            generator = torch.Generator().manual_seed(rank)
            times = []
            for _ in range(steps + 2):
                x = _inputs(shape, generator)
                comm.barrier(group)
                start = time.perf_counter()
                _loss(shape, model, x).backward()
                engine.backward_done()
                engine.step(optimizer)
                comm.barrier(group)
                times.append(time.perf_counter() - start)
            out.append(statistics.median(times[2:]))
            engine.close()
            del engine, model, optimizer
    finally:
        if fixed:
            memory.restore_mmap_threshold()
        dist.destroy_process_group()
    return out


def planned(shape: str, stage: int, offload: bool, world_size: int) -> object:
    """The plan of one case, as ``lightning-zero plan`` makes it (device ``cpu``)."""
    from lightning_zero.config import OffloadConfig, ZeroConfig
    from lightning_zero.plan import plan

    kind, config, dims = SHAPES[shape]
    source = {"gpt": "recipes.gpt2.model:GPT", "odd": "plan_check:OddMLP"}.get(kind, "common:SquareStack")
    inputs = [(dims, torch.int64 if kind == "gpt" else torch.float32)]
    return plan(
        source,
        world_size,
        zero=ZeroConfig(stage=stage),
        offload=OffloadConfig(offload_optimizer=offload),
        device="cpu",
        model_kwargs={"config": config} if kind == "gpt" else config,
        inputs=inputs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--calibration-seconds", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="tiny models, one timed step: checks the script")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        common.use_tiny_models()
        SHAPES["gpt"] = ("gpt", common.MODEL, (2, 16))
        SHAPES["gpt-deep"] = ("gpt", GPTConfig(vocab_size=128, block_size=32, n_layer=3, n_head=2, n_embd=16), (2, 32))
        SHAPES["square"] = ("square", None, (4, common.SQUARE_WIDTH))
        SHAPES["mlp-odd"] = ("odd", {"width": 10, "hidden": 29, "depth": 2}, (4, 10))
        args.steps, args.calibration_seconds = 1, 0.5
    from lightning_zero.plan.machine import calibrate, to_dict

    rows, machines, loads = [], {}, {}
    shapes = args.shapes.split(",")
    for world_size in (int(n) for n in args.ranks.split(",")):
        load_before = os.getloadavg()[0]  # other jobs on the machine make these numbers unreliable
        machine = calibrate(world_size, seconds=args.calibration_seconds)
        machines[world_size] = to_dict(machine)
        print(f"{world_size} ranks: {machine}", flush=True)
        cases = [(shape, label, stage, offload) for shape in shapes for label, stage, offload in LAYOUTS]
        measured = common.run_ranks(measure, cases, args.steps, world_size=world_size)[0]
        loads[world_size] = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        print(f"{world_size} ranks: load average {loads[world_size]}", flush=True)
        for (shape, label, stage, offload), seconds in zip(cases, measured, strict=True):
            predicted = planned(shape, stage, offload, world_size).step_time(machine)  # type: ignore[attr-defined]
            row = [
                shape,
                label,
                world_size,
                f"{predicted.seconds * 1e3:.0f}",
                f"{seconds * 1e3:.0f}",
                f"{predicted.seconds / seconds:.2f}",
                f"{(predicted.forward + predicted.backward) * 1e3:.0f}",
                f"{predicted.optimizer * 1e3:.0f}",
                f"{predicted.communication * 1e3:.0f} / {predicted.exposed_communication * 1e3:.0f}",
            ]
            rows.append(row)
            print(" | ".join(str(c) for c in row), flush=True)
    headers = [
        "shape",
        "layout",
        "ranks",
        "planned ms",
        "measured ms",
        "planned / measured",
        "planned fwd+bwd ms",
        "planned optimizer ms",
        "planned comm / exposed ms",
    ]
    print(common.format_table(headers, rows))
    ratios = [float(r[5]) for r in rows]
    within = sum(0.75 <= r <= 1.25 for r in ratios)
    summary = f"{within} of {len(ratios)} cases within 25% (ratios {min(ratios):.2f} to {max(ratios):.2f})"
    print(summary)
    command = "python benchmarks/plan_check.py " + " ".join(sys.argv[1:])
    common.write_json(
        args.json,
        {
            "machine": {**common.machine(), "ranks": f"{args.ranks} gloo ranks, 1 thread each"},
            "title": "plan_check.py: planned step time against measured steps",
            "topic": "step-time",
            "command": command.strip(),
            "headers": headers,
            "rows": rows,
            "notes": [
                summary,
                "1-minute load average before calibrating and after measuring, per world size: " + str(loads),
                "Calibrated machines (per world size): " + str(machines),
            ],
        },
    )


if __name__ == "__main__":
    main()
