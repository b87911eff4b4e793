"""How long the training loop stops per checkpoint save: synchronous vs asynchronous.

    python benchmarks/checkpoint_async.py [--layers 8] [--width 2048] [--steps 24] [--every 4] [--json out.json]

Two CPU/gloo ranks train a stack of ``--layers`` Linear(width, width) layers with ZeRO stage 2 and
AdamW (fp32 master + 2 states sharded: 12 bytes per parameter / 2 ranks in each rank's file), saving
one sharded checkpoint every ``--every`` steps into the same directory (each save replaces the
previous one, as ``ModelCheckpoint(save_last=True)`` does). Measured per rank, on the main thread:

- *stall per save*: the time inside ``trainer.save_checkpoint`` (synchronous: the whole write;
  asynchronous: the copy into host memory, plus waiting for the previous save's writer if it has not
  finished), plus the time the step boundaries and the end of fit spend publishing an async save
  (the all-gather of "done?", ``metadata.json``, the rename), divided by the number of saves;
- *waiting*: the part of the stall spent waiting for the previous save's writer thread (a save
  that comes before the previous one is written waits for it: one host copy at a time), so that
  the rest (the copy into the reused host buffer, the agreements, the publication) is seen apart;
  ``--every`` sets how many steps the writer has;
- *fit*: the wall time of ``trainer.fit`` with the saves;
- *disk*: this rank's write bandwidth (one file of the rank file's size, written and fsynced) measured
  first, and the synchronous save's bytes per second against it.

The ratio column is the asynchronous stall over the synchronous one (the issue's target is <= 0.10).
The writer thread shares the 2 cores with training here, so the async fit time includes that contention.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Stack(pl.LightningModule):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Stall:
    """Main-thread time spent saving: inside ``trainer.save_checkpoint`` and, outside it, in the
    async save's publication (``poll_save``/``commit_save`` from step boundaries and teardown)."""

    def __init__(self) -> None:
        from lightning_zero.checkpoint import save

        self.in_save = 0.0
        self.publishing = 0.0
        self.waiting = 0.0
        self.saves = 0
        self._inside = False
        for name in ("poll_save", "commit_save"):
            setattr(save, name, self._timed(getattr(save, name)))
        wait = save.PendingSave.wait

        def waited(pending: Any) -> None:
            start = time.perf_counter()
            try:
                wait(pending)
            finally:
                self.waiting += time.perf_counter() - start

        save.PendingSave.wait = waited  # type: ignore[method-assign]  # timed, as above

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            if self._inside:
                return fn(*args)
            self._inside = True
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.publishing += time.perf_counter() - start
                self._inside = False

        return timed

    def save(self, trainer: pl.Trainer, path: str) -> None:
        self._inside = True
        start = time.perf_counter()
        try:
            trainer.save_checkpoint(path)
        finally:
            self.in_save += time.perf_counter() - start
            self._inside = False
            self.saves += 1


class SaveEvery(pl.Callback):
    def __init__(self, every: int, path: str, stall: Stall) -> None:
        self.every, self.path, self.stall = every, path, stall

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.stall.save(trainer, self.path)


def disk_bandwidth(directory: str, nbytes: int) -> float:
    """Bytes per second of one fsynced write of ``nbytes`` into ``directory``."""
    data = torch.empty(nbytes, dtype=torch.uint8).numpy().tobytes()
    file = Path(directory) / f"probe-{os.getpid()}"
    start = time.perf_counter()
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    file.unlink()
    return nbytes / seconds


def _worker(rank: int, args: argparse.Namespace, directory: str) -> dict:
    from lightning_zero import ZeroStrategy

    common.ensure_process_group()
    stall = Stall()
    rows = {}
    params = args.layers * (args.width * args.width + args.width)
    shard_bytes = 12 * params // common.WORLD_SIZE
    rows["disk"] = disk_bandwidth(directory, shard_bytes)
    for mode in ("sync", "async"):
        stall.in_save = stall.publishing = stall.waiting = 0.0
        stall.saves = 0
        pl.seed_everything(3, verbose=False)
        model = Stack(args.layers, args.width)
        generator = torch.Generator().manual_seed(rank)
        loader = DataLoader(TensorDataset(torch.randn(args.steps * 4, args.width, generator=generator)), batch_size=4)
        strategy = ZeroStrategy(stage=2, async_save=mode == "async")
        trainer = common.make_trainer(
            strategy, "32-true", args.steps, [SaveEvery(args.every, f"{directory}/ck", stall)]
        )
        start = time.perf_counter()
        trainer.fit(model, train_dataloaders=loader)
        fit = time.perf_counter() - start
        rank_file = Path(directory) / "ck" / f"rank-{rank:05d}.pt"
        rows[mode] = {
            "saves": stall.saves,
            "in_save": stall.in_save,
            "publishing": stall.publishing,
            "waiting": stall.waiting,
            "fit": fit,
            "file_bytes": rank_file.stat().st_size,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        results = common.run_ranks(_worker, args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rows = []
    for rank, res in enumerate(results):
        sync, asyn = res["sync"], res["async"]
        per_sync = (sync["in_save"] + sync["publishing"]) / sync["saves"]
        per_async = (asyn["in_save"] + asyn["publishing"]) / asyn["saves"]
        sync_bw = sync["file_bytes"] / per_sync
        rows.append(
            [
                rank,
                f"{sync['file_bytes'] / 2**20:.0f}",
                f"{res['disk'] / 2**20:.0f}",
                f"{sync_bw / 2**20:.0f} ({sync_bw / res['disk']:.2f}x)",
                f"{per_sync * 1000:.0f}",
                f"{per_async * 1000:.0f} ({asyn['publishing'] * 1000 / asyn['saves']:.0f} publishing, "
                f"{asyn['waiting'] * 1000 / asyn['saves']:.0f} waiting)",
                f"{per_async / per_sync:.3f}",
                f"{sync['fit']:.1f} / {asyn['fit']:.1f}",
            ]
        )
    headers = [
        "rank",
        "rank file MiB",
        "disk MiB/s",
        "sync save MiB/s (x disk)",
        "sync stall ms/save",
        "async stall ms/save",
        "async/sync",
        "fit s sync / async",
    ]
    print(common.machine())
    print(f"load average: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} (1/5/15 min)")
    print(f"{args.layers} x Linear({args.width}), ZeRO stage 2, AdamW, {args.steps} steps, a save every {args.every}")
    print(common.format_table(headers, rows))
    common.write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
