"""Peak memory while building a model in ``configure_model``: zero3 (recorded on meta, replayed into
the shards one tensor at a time) against Lightning's DDP (each rank builds the whole model).

    python benchmarks/sharded_init.py [--world-size 4] [--layers 24] [--width 1024] [--json OUT]

Each rank resets its resident-set high-water mark (``/proc/self/clear_refs``) just before
``Trainer.fit`` and reads ``VmHWM`` and ``VmRSS`` at ``on_train_start`` (the model is built, sharded
and placed; no optimizer state yet, since the first step allocates it). Bytes are what the OS sees
for the process, so the allocator's slack is counted too. The bound checked: peak <=
the build's final footprint (shards and what setup keeps) + 2 x the largest single tensor. The model
is the GPT-2 of ``recipes/gpt2/model.py`` (tied embedding, GPT-2's init through ``apply``), fp32.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import common
import lightning.pytorch as pl
import torch

MIB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class Built(pl.LightningModule):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.gpt: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = common.GPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.gpt is not None
        (tokens,) = batch
        return self.gpt.loss_fn(self.gpt(tokens[:, :-1]), tokens[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Measure(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peak, self.after = _status("VmHWM"), _status("VmRSS")
        trainer.should_stop = True  # measured: no step is needed


def _worker(rank: int, system: str, config: Any, world: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeroStrategy

    common._quiet()
    pl.seed_everything(0, verbose=False)
    model, measure = Built(config), _Measure()
    strategy = DDPStrategy() if system == "ddp" else ZeroStrategy(stage=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        max_steps=1,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.randint(0, config.vocab_size, (4, 9))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    trainer.fit(model, train_dataloaders=loader)
    return {"before": before, "peak": measure.peak, "after": measure.after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.width % 64:
        raise ValueError(f"--width {args.width} must be a multiple of 64 (heads of 64)")
    config = common.GPTConfig(
        vocab_size=8192, block_size=64, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width
    )
    with torch.device("meta"):
        reference = common.GPT(config)
    tensors = {id(t): t for t in [*reference.parameters(), *reference.buffers()]}.values()
    full = sum(t.numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows, payload = [], {"machine": common.machine(), "full_bytes": full, "largest_bytes": largest, "systems": {}}
    for system in ("ddp", "zero3"):
        results = common.run_ranks(_worker, system, config, args.world_size, world_size=args.world_size)
        peak = max(r["peak"] - r["before"] for r in results)
        kept = max(r["after"] - r["before"] for r in results)
        bound = kept + 2 * largest
        payload["systems"][system] = {"ranks": results, "peak": peak, "kept": kept, "bound": bound}
        rows.append([system, f"{peak / MIB:.0f}", f"{kept / MIB:.0f}", f"{bound / MIB:.0f}", f"{peak / full:.2f}"])
    ddp_peak = payload["systems"]["ddp"]["peak"]
    for row, system in zip(rows, ("ddp", "zero3"), strict=True):
        row.append(f"{payload['systems'][system]['peak'] / ddp_peak:.2f}")
        row.append("yes" if payload["systems"][system]["peak"] <= payload["systems"][system]["bound"] else "NO")
    print(
        f"GPT {sum(t.numel() for t in tensors) / 1e6:.0f}M parameters, fp32 {full / MIB:.0f} MiB, largest tensor "
        f"{largest / MIB:.0f} MiB, {args.world_size} CPU/gloo ranks; bytes per rank as the OS sees them (max over ranks)"
    )
    headers = ["system", "peak MiB", "after build MiB", "bound MiB", "peak / model", "peak / DDP", "peak <= bound"]
    print(common.format_table(headers, rows))
    common.write_json(args.json, payload)


if __name__ == "__main__":
    main()
