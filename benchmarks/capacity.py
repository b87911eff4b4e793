"""ZeRO-Infinity's disk tier against CPU offload on one rank, with the disk measured first.

    python benchmarks/capacity.py --nvme-path /tmp/lz_nvme [--layers 6 --width 384] [--steps 3] [--stage 3]

1. The disk under ``--nvme-path``: O_DIRECT writes then reads of ``--disk-mib`` MiB in 1 MiB
   page-aligned blocks (as ``dd oflag=direct``), GB/s.
2. The same GPT (recipes/gpt2/model.py, AdamW, fp32 unless ``--precision``) trained ``--steps``
   steps on one repeated batch under ``offload_optimizer=True`` and ``offload_optimizer="nvme"``,
   each in its own process (peak RSS is per process); with ``--stage 3`` also a third run with the
   parameter shards on disk too (``offload_parameters="nvme"``, row "nvme+params"). Per tier: mean step time after the first,
   the optimizer phase (from ``on_before_optimizer_step`` to the end of the batch), the seconds
   that phase waited on reads and on writes, bytes moved per step and their rate over the
   optimizer phase as a fraction of the measured disk bandwidth (with parameters on disk the bytes
   include the parameter reads of forward and backward, whose wait is its own column), peak RSS, the first and last
   loss, and whether the swap directory is gone afterwards. The last row is the ratio nvme / cpu.

``--deepspeed`` (with ``--stage 3``) adds DeepSpeed's ZeRO-Infinity on the same model and batch
(``deepspeed_nvme.py``: its row, or the error that kept it from running).

``--aio-engine`` picks the I/O engine (``NvmeConfig.aio_engine``, default "auto": io_uring where it
works); the engine that ran is printed (a column, or the capacity run's header line). Under the
Python engine the swap files go through the page cache, so on a machine with free RAM its reads may
be served from memory. ``benchmarks/nvme_io.py`` measures the engines' I/O alone.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _cpu_and_pool() -> tuple[float, float, int]:
    """CPU seconds of this process so far (user, system: every thread, the I/O ones too) and the
    allocations the disk tier's host pool has made (csrc/cpu/host_pool.cpp; 0 without the build)."""
    import torch

    usage = resource.getrusage(resource.RUSAGE_SELF)
    pool = getattr(torch.ops.lightning_zero, "host_pool_stats", None)
    return usage.ru_utime, usage.ru_stime, int(pool()[3]) if pool is not None else 0


def measure_disk(path: str, mib: int) -> dict[str, float]:
    """O_DIRECT write (with fsync) and read of ``mib`` MiB in 1 MiB aligned blocks: GB/s each."""
    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, "lz_disk_probe.bin")
    block = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(1 << 20))
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(file, flags, 0o600)
    try:
        start = time.perf_counter()
        for i in range(mib):
            os.pwrite(fd, block, i << 20)
        os.fsync(fd)
        write = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(mib):
            os.preadv(fd, [block], i << 20)
        read = time.perf_counter() - start
    finally:
        os.close(fd)
        os.remove(file)
    return {"write_gbs": mib * 2**20 / write / 1e9, "read_gbs": mib * 2**20 / read / 1e9}


def child(args: argparse.Namespace) -> dict:
    """One tier's run (in its own process)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import GPTModule
    from lightning_zero import ZeroStrategy
    from recipes.gpt2.model import GPTConfig

    config = GPTConfig(vocab_size=8192, block_size=128, n_layer=args.layers, n_head=6, n_embd=args.width)
    pl.seed_everything(0, verbose=False)
    module = GPTModule(config)
    tokens = torch.randint(0, config.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    batch = TensorDataset(tokens[:, :-1].repeat(args.steps, 1), tokens[:, 1:].repeat(args.steps, 1))
    tier: bool | str = True if args.tier == "cpu" else "nvme"
    strategy = ZeroStrategy(
        stage=args.stage,
        offload_optimizer=tier,
        offload_parameters="nvme" if args.tier == "nvme+params" else False,
        nvme_path=args.nvme_path if tier == "nvme" else None,
        nvme_config={"aio_engine": args.aio_engine, **json.loads(args.nvme_config)} if tier == "nvme" else None,
    )

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.optimizer: list[float] = []
            self.losses: list[float] = []
            self.stalls: list[dict[str, float]] = []
            self.compute_reads: list[float] = []  # seconds forward/backward waited on parameter reads

        @staticmethod
        def store(trainer):  # reaches inside on purpose: the I/O counters of the rank's swap files
            engine = trainer.strategy._engine
            return engine._store() if engine is not None else None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.t0 = time.perf_counter()
            store = self.store(trainer)
            self.start = dict(store.stall) if store else {"read": 0.0, "write": 0.0}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.t1 = time.perf_counter()
            store = self.store(trainer)
            self.before = dict(store.stall) if store else {"read": 0.0, "write": 0.0}
            self.compute_reads.append(self.before["read"] - self.start["read"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            self.steps.append(now - self.t0)
            self.optimizer.append(now - self.t1)
            self.losses.append(float(outputs["loss"]))
            store = self.store(trainer)
            after = store.stall if store else {"read": 0.0, "write": 0.0}
            self.stalls.append({k: after[k] - self.before[k] for k in after})
            if store:
                self.bytes = (store.bytes_read, store.bytes_written)
                self.engine = store.engine

    timer = Timer()
    trainer = _trainer(strategy, args.precision, args.steps, timer)
    # counted before fit: with the parameters on disk the module's shards stay empty after it (restore_after_fit)
    psi = sum(p.numel() for p in module.parameters() if p.requires_grad)
    trainer.fit(module, DataLoader(batch, batch_size=4))
    rest = slice(1, None) if args.steps > 1 else slice(None)
    read, written = getattr(timer, "bytes", (0, 0))
    return {
        "params": psi,
        "step_s": sum(timer.steps[rest]) / len(timer.steps[rest]),
        "optimizer_s": sum(timer.optimizer[rest]) / len(timer.optimizer[rest]),
        "read_stall_s": sum(s["read"] for s in timer.stalls[rest]) / len(timer.stalls[rest]),
        "compute_read_s": sum(timer.compute_reads[rest]) / len(timer.compute_reads[rest]),
        "write_stall_s": sum(s["write"] for s in timer.stalls[rest]) / len(timer.stalls[rest]),
        "bytes_per_step": (read + written) / args.steps,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss_first": timer.losses[0],
        "loss_last": timer.losses[-1],
        "clean": not any(Path(args.nvme_path).glob("lightning_zero-rank*")),
        "engine": getattr(timer, "engine", "-"),
    }


def _peak_gib() -> float:
    """This process's peak resident set (``VmHWM``) as the OS counts it, GiB."""
    from lightning_zero.memory import resident_bytes

    return resident_bytes().get("peak_resident", float("nan")) / 2**30


def _trainer(strategy: Any, precision: str, steps: int, timer: Any) -> Any:
    """A one-process CPU Trainer with no logging or checkpoints: only ``timer`` watches."""
    import lightning.pytorch as pl  # in the child only, as the callers' imports

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def capacity_child(args: argparse.Namespace) -> dict:
    """The capacity run: a GPT built in ``configure_model`` (straight to disk), stage 3 with
    parameters, gradients and optimizer states on disk, one CPU rank, bf16-mixed, ``--steps`` steps
    on one repeated batch of ``--tokens`` tokens. Per step: time, the waits on reads and writes, bytes
    moved, the seconds during which each direction had a request running (``SwapStore.busy``: bytes
    over these are the rates the I/O itself reached, against bytes over the whole step, which also
    count the stretches a direction has nothing to move, e.g. no writes in forward), CPU seconds of the process (user / system, the I/O threads included) and the allocations of
    the tier's host pool (0 once it is in its steady state)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from recipes.gpt2.model import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=args.vocab,
        block_size=max(64, args.tokens),
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )

    class Deferred(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: GPT | None = None

        def configure_model(self) -> None:  # meta + recorded under stage 3, replayed into the files
            if self.model is None:
                self.model = GPT(config)

        def training_step(self, batch, batch_idx):
            input_ids, labels = batch
            return GPT.loss_fn(self.model(input_ids), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(0, config.vocab_size, (1, args.tokens + 1), generator=torch.Generator().manual_seed(0))
    batch = TensorDataset(tokens[:, :-1].repeat(args.steps, 1), tokens[:, 1:].repeat(args.steps, 1))
    strategy = ZeroStrategy(
        stage=3,
        offload_optimizer="nvme",
        offload_parameters="nvme",
        nvme_path=args.nvme_path,
        nvme_config={"aio_engine": args.aio_engine, **json.loads(args.nvme_config)},
        # restore_after_fit left at its default: with the parameters on disk the end of fit brings
        # neither the states (38 GB at 3.2B) nor the whole model (6.7 GB in bf16) back into RAM
    )

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        @staticmethod
        def store(trainer):  # reaches inside on purpose: the I/O counters of the rank's swap files
            return trainer.strategy._engine._store()

        def on_train_start(self, trainer, pl_module) -> None:
            self.setup_hwm = _peak_gib()
            self.engine = self.store(trainer).engine  # the I/O engine that runs (aio_engine may fall back)
            # (the module's parameters are empty tensors here: their shards are on disk)
            self.params = sum(math.prod(h.shape) for h in trainer.strategy._engine.held_params())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            s = self.store(trainer)
            self.start = (
                time.perf_counter(),
                dict(s.stall),
                s.bytes_read,
                s.bytes_written,
                _cpu_and_pool(),
                dict(s.busy),
            )

        def _mark(self, trainer) -> None:
            s = self.store(trainer)
            self.marks.append((time.perf_counter(), s.stall["read"], s.stall["write"]))

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self.marks = []
            self._mark(trainer)

        def on_after_backward(self, trainer, pl_module) -> None:
            self._mark(trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._mark(trainer)
            s = self.store(trainer)
            t0, stall, read0, written0, (user0, sys0, allocations0), busy = self.start
            user, system, allocations = _cpu_and_pool()
            self.rows.append(
                {
                    "step_s": time.perf_counter() - t0,
                    "read_wait_s": s.stall["read"] - stall["read"],
                    "write_wait_s": s.stall["write"] - stall["write"],
                    "read_gb": (s.bytes_read - read0) / 1e9,
                    "written_gb": (s.bytes_written - written0) / 1e9,
                    # seconds with at least one read (write) running: the I/O's own rate is bytes over these
                    "read_busy_s": s.busy["read"] - busy["read"],
                    "write_busy_s": s.busy["write"] - busy["write"],
                    "loss": float(outputs["loss"]),
                    "hwm_gib": _peak_gib(),
                    "user_s": user - user0,
                    "sys_s": system - sys0,
                    "host_allocations": allocations - allocations0,
                    # per phase (forward, backward, optimizer step): seconds, read wait, write wait
                    "phases": [
                        [round(b[k] - a[k], 2) for k in range(3)]
                        for a, b in zip([(t0, stall["read"], stall["write"]), *self.marks], self.marks, strict=False)
                    ],
                }
            )
            # also at once on stderr (inherited by the parent): a run stopped later keeps its finished steps
            print(f"step {len(self.rows)} done at load {os.getloadavg()}: {json.dumps(self.rows[-1])}", file=sys.stderr)
            sys.stderr.flush()

        def on_train_end(self, trainer, pl_module) -> None:
            self.train_hwm = _peak_gib()

    timer = Timer()
    trainer = _trainer(strategy, "bf16-mixed", args.steps, timer)
    start = time.perf_counter()
    trainer.fit(Deferred(), DataLoader(batch, batch_size=1))
    return {
        "params": timer.params,
        "rows": timer.rows,
        "setup_hwm_gib": timer.setup_hwm,
        "train_hwm_gib": timer.train_hwm,
        "process_hwm_gib": _peak_gib(),
        "fit_s": time.perf_counter() - start,
        "clean": not any(Path(args.nvme_path).glob("lightning_zero-rank*")),
        "engine": timer.engine,
    }


def capacity(args: argparse.Namespace) -> None:
    """Disk first, then the capacity run in its own process; the swap directory is removed whatever happens."""
    import shutil

    try:
        disk = measure_disk(args.nvme_path, args.disk_mib)
        print(f"load before: {os.getloadavg()}")
        print(
            f"disk under {args.nvme_path}: O_DIRECT write {disk['write_gbs']:.3f} GB/s, read {disk['read_gbs']:.3f} GB/s"
        )
        command = [sys.executable, __file__, *sys.argv[1:], "--tier", "capacity"]
        # stderr inherited: the child's warnings and per-step lines appear as they happen
        out = subprocess.run(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if out.returncode != 0:
            raise SystemExit(f"capacity run failed (exit {out.returncode})")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"load after: {os.getloadavg()}")
        print(
            f"{r['params'] / 1e9:.3f}B parameters, one CPU rank, bf16-mixed, stage 3, parameters + gradients + "
            f"optimizer states on disk; {args.tokens} tokens per step; I/O engine {r['engine']}; fit {r['fit_s']:.0f} s"
        )
        print(
            "step | step s | compute s | read wait s | write wait s | GB read | GB written | read GB/s (x disk) | "
            "write GB/s (x disk) | disk busy (x step) | read / write running s | read / write GB/s while running (x disk) | "
            "CPU s user / sys | host allocations | loss | VmHWM GiB"
        )
        for i, row in enumerate(r["rows"], 1):
            compute = row["step_s"] - row["read_wait_s"] - row["write_wait_s"]
            rate_r, rate_w = row["read_gb"] / row["step_s"], row["written_gb"] / row["step_s"]
            # seconds the disk needs for this step's bytes at the rates measured above, over the step
            busy = (row["read_gb"] / disk["read_gbs"] + row["written_gb"] / disk["write_gbs"]) / row["step_s"]
            # the rates of the I/O itself: bytes over the seconds that direction had a request running
            run_r, run_w = row["read_gb"] / row["read_busy_s"], row["written_gb"] / row["write_busy_s"]
            print(
                f"{i} | {row['step_s']:.1f} | {compute:.1f} | {row['read_wait_s']:.1f} | {row['write_wait_s']:.1f} | "
                f"{row['read_gb']:.2f} | {row['written_gb']:.2f} | {rate_r:.3f} ({rate_r / disk['read_gbs']:.2f}) | "
                f"{rate_w:.3f} ({rate_w / disk['write_gbs']:.2f}) | {busy:.2f} | "
                f"{row['read_busy_s']:.1f} / {row['write_busy_s']:.1f} | {run_r:.3f} ({run_r / disk['read_gbs']:.2f}) / "
                f"{run_w:.3f} ({run_w / disk['write_gbs']:.2f}) | {row['user_s']:.1f} / {row['sys_s']:.1f} | "
                f"{row['host_allocations']} | {row['loss']:.4f} | {row['hwm_gib']:.2f}"
            )
        print(
            f"peak RSS (VmHWM) GiB: after setup {r['setup_hwm_gib']:.2f}, end of training {r['train_hwm_gib']:.2f}, "
            f"whole process (incl. the end of fit) {r['process_hwm_gib']:.2f}; swap directory removed: {r['clean']}"
        )
    finally:
        shutil.rmtree(args.nvme_path, ignore_errors=True)
        print(f"removed {args.nvme_path}: {not os.path.exists(args.nvme_path)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--disk-mib", type=int, default=512)
    parser.add_argument("--stage", type=int, choices=[2, 3], default=2)
    parser.add_argument("--capacity", action="store_true", help="the capacity run (see capacity_child)")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-6,
        help="the capacity run's AdamW learning rate. On its one repeated 8-token batch the first update "
        "nearly memorizes the batch at 1e-4 or 1e-5 and Adam's momentum then overshoots (3.3B, steps 1-3: "
        "11.39, 1.51, 11.39 at 1e-4; 11.39, 0.13, 5.09 at 1e-5); at 1e-6 the loss falls at every step "
        "(11.39, 5.39, 1.14)",
    )
    parser.add_argument(
        "--aio-engine", default="auto", choices=["auto", "io_uring", "threads", "python"], help="NvmeConfig.aio_engine"
    )
    parser.add_argument(
        "--nvme-config",
        default="{}",
        help="more NvmeConfig knobs for our disk tiers, as JSON (e.g. '{\"buffer_count\": 4}')",
    )
    parser.add_argument(
        "--deepspeed", action="store_true", help="with --stage 3: DeepSpeed's NVMe offload too (deepspeed_nvme.py)"
    )
    parser.add_argument("--tier", choices=["cpu", "nvme", "nvme+params", "capacity", "ds"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tier == "capacity":
        print(json.dumps(capacity_child(args)))
        return
    if args.tier == "ds":
        from benchmarks.deepspeed_nvme import ds_child

        print(json.dumps(ds_child(args)))
        return
    if args.tier:
        print(json.dumps(child(args)))
        return
    if args.capacity:
        capacity(args)
        return
    disk = measure_disk(args.nvme_path, args.disk_mib)
    print(f"disk under {args.nvme_path}: O_DIRECT write {disk['write_gbs']:.3f} GB/s, read {disk['read_gbs']:.3f} GB/s")
    rows = {}
    for tier in ("cpu", "nvme", "nvme+params") if args.stage == 3 else ("cpu", "nvme"):
        command = [sys.executable, __file__, *sys.argv[1:], "--tier", tier]
        out = subprocess.run(
            command, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        rows[tier] = json.loads(out.stdout.strip().splitlines()[-1])
    bandwidth = (disk["read_gbs"] + disk["write_gbs"]) / 2
    header = (
        "tier | engine | params | step s | fwd/bwd read wait s | optimizer s | read wait s | write wait s | GB/step | "
        "GB/s in opt phase (x disk) | peak RSS GiB | loss first -> last | clean"
    )
    print(header)
    for tier, r in rows.items():
        rate = r["bytes_per_step"] / r["optimizer_s"] / 1e9
        print(
            f"{tier} | {r['engine']} | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {r['compute_read_s']:.3f} | {r['optimizer_s']:.3f} | "
            f"{r['read_stall_s']:.3f} | "
            f"{r['write_stall_s']:.3f} | {r['bytes_per_step'] / 1e9:.3f} | {rate:.3f} ({rate / bandwidth:.2f}) | "
            f"{r['peak_rss_gib']:.2f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['clean']}"
        )
    if args.deepspeed and args.stage == 3:
        command = [sys.executable, __file__, *sys.argv[1:], "--tier", "ds"]
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        lines = out.stdout.strip().splitlines()
        r = json.loads(lines[-1]) if out.returncode == 0 and lines else {"error": out.stderr.strip()[-500:]}
        if "error" in r:
            print(f"DeepSpeed nvme+params | did not run: {r['error']}")
        else:
            rows["DeepSpeed nvme+params"] = r
            print(
                f"DeepSpeed nvme+params | libaio | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | - | {r['optimizer_s']:.3f} | "
                f"- | - | - | - | {r['peak_rss_gib']:.2f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['clean']}"
            )
    c = rows["cpu"]
    for tier in [t for t in rows if t != "cpu"]:
        n = rows[tier]
        print(
            f"{tier} / cpu | | | {n['step_s'] / c['step_s']:.2f} | | {n['optimizer_s'] / c['optimizer_s']:.2f} | | | | | "
            f"{n['peak_rss_gib'] / c['peak_rss_gib']:.2f} | |"
        )


if __name__ == "__main__":
    main()
