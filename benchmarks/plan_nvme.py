"""The plan's NVMe tiers against the real engine writing real swap files on this machine.

Run: ``python benchmarks/plan_nvme.py [--ranks 2] [--steps 5] [--nvme-path DIR] [--json benchmarks/results/plan-nvme.json]``
     ``--quick``: tiny models, one step each (checks the script, not the numbers)

For each world size, :func:`lightning_zero.plan.machine.calibrate` measures this machine as that many
gloo ranks, with its disk under ``--nvme-path`` (every rank writing and reading a swap file at once);
then the same ranks train the shapes of ``benchmarks/plan_check.py`` (bf16-mixed AdamW) with the
optimizer on NVMe at stages 2 and 3 and with the parameters on NVMe too at stage 3, through the
engine itself, timing each step between barriers (the first two dropped, the median of the rest) and
counting rank 0's swap files and its store's bytes read and written per step. Beside each: the plan
of the case (meta tensors, fake process group, the disk tier's file I/O recorded) and its predicted
step on the calibrated machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import plan_check
import torch
import torch.distributed as dist

#: (label, stage, offload_parameters); the optimizer is on NVMe in every layout
LAYOUTS = [("zero2_nvme", 2, False), ("zero3_nvme", 3, False), ("zero3_nvme_params", 3, "nvme")]


def _offload(path: str, parameters: object) -> object:
    from lightning_zero.config import NvmeConfig, OffloadConfig

    return OffloadConfig(offload_optimizer="nvme", offload_parameters=parameters, nvme=NvmeConfig(path=path))


def _quick() -> None:
    """Tiny models (in this process and in every spawned rank)."""
    common.use_tiny_models()
    plan_check.SHAPES["gpt"] = ("gpt", common.MODEL, (2, 16))
    plan_check.SHAPES["square"] = ("square", None, (4, common.SQUARE_WIDTH))


def measure(
    rank: int, cases: list[tuple[str, str, int, object]], steps: int, root: str, quick: bool
) -> list[dict[str, float]]:
    """Per case: median step seconds (rank 0's clock, between barriers), this rank's swap-file bytes
    and its store's bytes read and written in the last step."""
    from lightning_zero import comm
    from lightning_zero.config import StrategyConfig, ZeroConfig
    from lightning_zero.zero.engine import ZeroEngine

    if quick:
        _quick()
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    out = []
    try:
        for index, (shape, _, stage, parameters) in enumerate(cases):
            torch.manual_seed(0)
            model = plan_check._model(shape)
            optimizer = torch.optim.AdamW(model.parameters())
            offload = _offload(os.path.join(root, str(index)), parameters)
            config = StrategyConfig(zero=ZeroConfig(stage=stage), offload=offload)  # type: ignore[arg-type]
            engine = ZeroEngine(model, [optimizer], config=config, precision="bf16-mixed", device=torch.device("cpu"))
            store = engine.swap.store  # type: ignore[union-attr]
            generator = torch.Generator().manual_seed(rank)
            times = []
            for _ in range(steps + 2):
                x = plan_check._inputs(shape, generator)
                comm.barrier(group)
                before = store.bytes_read, store.bytes_written
                start = time.perf_counter()
                plan_check._loss(shape, model, x).backward()
                engine.backward_done()
                engine.step(optimizer)
                comm.barrier(group)
                times.append(time.perf_counter() - start)
            files = sum(f.stat().st_size for f in store.directory.glob("*.swp"))
            out.append(
                {
                    "seconds": statistics.median(times[2:]),
                    "files": files,
                    "read": store.bytes_read - before[0],
                    "written": store.bytes_written - before[1],
                }
            )
            engine.close()
            del engine, model, optimizer
    finally:
        dist.destroy_process_group()
    return out


def planned(shape: str, stage: int, parameters: object, world_size: int, root: str) -> object:
    """The plan of one case (device ``cpu``)."""
    from lightning_zero.config import ZeroConfig
    from lightning_zero.plan import plan

    kind, config, dims = plan_check.SHAPES[shape]
    source = "recipes.gpt2.model:GPT" if kind == "gpt" else "common:SquareStack"
    return plan(
        source,
        world_size,
        zero=ZeroConfig(stage=stage),
        offload=_offload(root, parameters),  # type: ignore[arg-type]
        device="cpu",
        model_kwargs={"config": config} if config is not None else None,
        inputs=[(dims, torch.int64 if kind == "gpt" else torch.float32)],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shapes", default="gpt,square")
    parser.add_argument("--nvme-path", default=None, help="a directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--calibration-seconds", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="tiny models, one timed step: checks the script")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        _quick()
        args.steps, args.calibration_seconds = 1, 0.5
    from lightning_zero.plan.machine import calibrate

    root = tempfile.mkdtemp(prefix="plan_nvme_", dir=args.nvme_path)
    rows = []
    try:
        for world_size in (int(n) for n in args.ranks.split(",")):
            machine = calibrate(world_size, seconds=args.calibration_seconds, nvme_path=root)
            print(f"{world_size} ranks: NVMe read {machine.nvme_read / 1e9:.2f} GB/s, write "
                  f"{machine.nvme_write / 1e9:.2f} GB/s per rank", flush=True)  # fmt: skip
            cases = [(shape, label, stage, p) for shape in args.shapes.split(",") for label, stage, p in LAYOUTS]
            measured = common.run_ranks(measure, cases, args.steps, root, args.quick, world_size=world_size)[0]
            for (shape, label, stage, parameters), real in zip(cases, measured, strict=True):
                p = planned(shape, stage, parameters, world_size, root)
                t = p.step_time(machine)  # type: ignore[attr-defined]
                disk = p.nvme  # type: ignore[attr-defined]
                row = [
                    shape,
                    label,
                    world_size,
                    f"{disk.nvme_bytes / 2**20:.1f} / {real['files'] / 2**20:.1f}",
                    f"{disk.read_per_step / 2**20:.1f} / {real['read'] / 2**20:.1f}",
                    f"{disk.written_per_step / 2**20:.1f} / {real['written'] / 2**20:.1f}",
                    f"{disk.staging_bytes / 2**20:.1f}",
                    f"{t.seconds * 1e3:.0f}",
                    f"{real['seconds'] * 1e3:.0f}",
                    f"{t.seconds / real['seconds']:.2f}",
                    f"{t.disk * 1e3:.0f} / {t.exposed_disk * 1e3:.0f}",
                ]
                rows.append(row)
                print(" | ".join(str(c) for c in row), flush=True)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    headers = [
        "shape",
        "layout",
        "ranks",
        "files MiB planned / real",
        "read MiB per step planned / real",
        "written MiB per step planned / real",
        "planned staging MiB",
        "planned ms",
        "measured ms",
        "planned / measured",
        "planned disk / exposed ms",
    ]
    print(common.format_table(headers, rows))
    command = "python benchmarks/plan_nvme.py " + " ".join(sys.argv[1:])
    common.write_json(
        args.json,
        {
            "machine": {**common.machine(), "ranks": f"{args.ranks} gloo ranks, 1 thread each"},
            "title": "plan_nvme.py: the plan's NVMe tiers against real swap files",
            "topic": "nvme",
            "command": command.strip(),
            "headers": headers,
            "rows": rows,
            "notes": ["Per rank (rank 0). Planned step time on this machine calibrated with its disk."],
        },
    )


if __name__ == "__main__":
    main()
